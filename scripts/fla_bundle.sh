#!/usr/bin/env bash
# Builds .whl/fla_tilelang.tar.xz: flash-linear-attention (fla-core, flash-linear-attention 0.6.0)
# with TileLang 0.1.15 and what it imports, for the GPU machine (no network, 64 MiB a call).
# Why TileLang: on Hopper with Triton 3.4-3.7.0 (torch 2.11 ships 3.6) fla's gated chunk backward
# is wrong (fla issue 640) and fla raises; with TileLang installed fla dispatches that kernel to it.
# Triton >= 3.7.1 would do too, but its wheel is ~200 MB. Stripped: z3's command-line binary; kept:
# everything tilelang imports (its Ascend package included: fla imports it). About 46 MB.
#   bash scripts/fla_bundle.sh        (here, with network; then carry .whl in device calls)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform any -d "$work/wheels" \
  fla-core==0.6.0 flash-linear-attention==0.6.0 tilelang==0.1.15 apache-tvm-ffi==0.1.12 z3-solver==4.15.4.0 \
  torch-c-dlpack-ext==0.1.5
mkdir -p "$work/site" .whl
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -rf "$work"/site/z3_solver-*.data
tar cJf .whl/fla_tilelang.tar.xz -C "$work/site" .
ls -la .whl/fla_tilelang.tar.xz
