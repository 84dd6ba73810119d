#!/usr/bin/env bash
# Builds .whl/unsloth_offline.tar.gz: Unsloth 2026.10.9 and what it imports that the GPU image lacks,
# unpacked into one site folder, for a device call (no network there). benchmarks/w4_unsloth.py
# extracts it (ensure_bundle) and puts it first on sys.path; its docstring lists the contents and why.
# Installed the way a user on an offline cluster would: wheels fetched here with `pip download`,
# unpacked without what does not run on that machine: Unsloth's studio/ web UI and unsloth_cli/,
# and every bitsandbytes library but CUDA 13.0's and the CPU one. About 12 MB compressed.
#   bash scripts/unsloth_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheels=(unsloth==2026.10.9 unsloth_zoo==2026.10.9 cut_cross_entropy==25.1.1 tyro==1.0.17
        docstring_parser==0.18.0 typeguard==4.6.1 msgspec==0.23.0 datasets==4.8.5 dill==0.4.1
        multiprocess==0.70.19 trl==1.15.0 torchao==0.18.0 bitsandbytes==0.50.2)
# the device image: CPython 3.12 on x86-64 Linux (msgspec is the only compiled wheel besides torchao's
# abi3 one and bitsandbytes' libraries)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/wheels" --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 "${wheels[@]}" 2>&1 | grep -v "is ignored" || true
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -rf "$work/site/studio" "$work/site/unsloth_cli" "$work/site/unsloth/studio"
find "$work/site/bitsandbytes" -name 'libbitsandbytes_*.so' \
  ! -name libbitsandbytes_cuda130.so ! -name libbitsandbytes_cpu.so -delete
find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
(cd "$work/wheels" && ls -1 *.whl) > "$work/site/UNSLOTH_BUNDLE_MANIFEST.txt"
mkdir -p .whl
tar czf .whl/unsloth_offline.tar.gz -C "$work/site" .
ls -la .whl/unsloth_offline.tar.gz
