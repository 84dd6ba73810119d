#!/usr/bin/env bash
# Builds .whl/transformers_pruned.tar.xz: a transformers release newer than the GPU image's (5.17)
# for a device call, pruned to the model folders a run needs (and those their runtime files import)
# so that it fits beside the fla bundle and cudnn-frontend in one call's 64 MiB. scripts/gpu_parts.sh
# unpacks it into /tmp/site, ahead of the image's transformers on PYTHONPATH. About 1.5 MB for the
# hybrids; the whole wheel is 13.5 MB.
#   bash scripts/transformers_bundle.sh 5.24.0 lfm2 qwen3_next qwen3_5 qwen3_5_moe olmo_hybrid llama4
# 5.25 imports huggingface-hub >= 2.4, which the GPU image lacks (1.33; 8448fa1's call failed on it):
# carry 5.24 this way, or 5.25 with its hub through scripts/transformers_site_bundle.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$1; shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" "transformers==$version"
unzip -q "$work"/transformers-*.whl -d "$work/site"
python3 - "$work/site/transformers/models" "$@" <<'PY'
import os, re, shutil, sys
from pathlib import Path

models, keep = Path(sys.argv[1]), {"auto", "encoder_decoder", *sys.argv[2:]}
todo = list(keep)
while todo:  # the folders the kept ones import at run time (modular_*.py files are build sources)
    for source in (models / todo.pop()).glob("*.py"):
        if source.name.startswith("modular_"):
            continue
        for dep in re.findall(r"from \.\.([a-z0-9_]+)", source.read_text()):
            if dep not in keep and (models / dep).is_dir():
                keep.add(dep)
                todo.append(dep)
for folder in models.iterdir():
    if folder.is_dir() and folder.name not in keep and folder.name != "__pycache__":
        shutil.rmtree(folder)
for source in models.glob("*/modular_*.py"):
    source.unlink()
print("kept:", " ".join(sorted(keep)))
PY
mkdir -p .whl
tar cJf .whl/transformers_pruned.tar.xz -C "$work/site" .
ls -la .whl/transformers_pruned.tar.xz
