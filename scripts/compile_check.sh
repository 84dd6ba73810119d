#!/usr/bin/env bash
# Compile every torch-free CUDA kernel file for sm_80 and sm_90 with nvcc; needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile-check: nvcc not found; CUDA kernels NOT compile-checked" >&2
  exit 1
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
n=0
for src in csrc/kernels/*.cu; do
  for arch in 80 90; do
    nvcc -std=c++17 -O3 -Xptxas -warn-spills -gencode "arch=compute_${arch},code=sm_${arch}" \
      -Icsrc/include -c "$src" -o "$out/$(basename "$src").sm${arch}.o"
  done
  n=$((n + 1))
done
echo "compile-check: $n CUDA kernel file(s) compiled for sm_80 and sm_90"
