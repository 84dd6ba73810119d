#!/usr/bin/env bash
# Builds .whl/transformers_site.tar.xz: a whole transformers release newer than the GPU image's
# (5.17) with the packages it needs beyond the image, installed for the device's Python 3.12 and
# packed with xz (transformers 5.25 with the `kernels` package and huggingface_hub 2.4's
# dependencies: 7.1 MB, against 18 MB as wheels), so that it fits beside the fla bundle (46 MB) in
# one call's 64 MiB. scripts/gpu_parts.sh unpacks .whl/*.tar.xz into /tmp/site, ahead of the
# image's transformers on PYTHONPATH, for every part of that call (benchmarks included: leave it
# out of a call whose W4 compares with Unsloth, which caps transformers at 5.17).
# hf_xet is left out: huggingface_hub imports it only to download, and the machine has no network.
#   bash scripts/transformers_site_bundle.sh 5.25.0
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-5.25.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q -d "$work/wheels" "transformers==$version" kernels huggingface_hub \
  --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all:
# what the image already has at a version this transformers accepts
rm -f "$work"/wheels/{hf_xet,pydantic,pydantic_core,annotated_types,typing_inspection,tokenizers,safetensors,numpy,regex,pyyaml,packaging,tqdm,typer,filelock,fsspec,typing_extensions,shellingham,rich,markdown_it_py,mdurl,pygments,certifi,annotated_doc}-*.whl
python3 -m pip install -q --no-deps --no-compile --target "$work/site" --python-version 3.12 \
  --platform manylinux2014_x86_64 --only-binary=:all: "$work"/wheels/*.whl
mkdir -p .whl
tar cJf .whl/transformers_site.tar.xz -C "$work/site" .
ls -la .whl/transformers_site.tar.xz
