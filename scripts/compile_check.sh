#!/usr/bin/env bash
# No GPU needed. 1) Every torch-free CUDA kernel (csrc/kernels/*.cu) compiled with nvcc for
# sm_80 and sm_90. 2) The torch-facing CUDA glue (csrc/*/*_cuda.cpp) syntax-checked by the host
# compiler against the installed torch's headers (a CPU wheel lacks one generated header,
# c10/cuda/impl/cuda_cmake_macros.h, which is stood in for here).
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

cuda_include=""
for dir in "${CUDA_HOME:-}/include" "$(dirname "$(dirname "$(command -v nvcc)")")/include" /usr/local/cuda/include; do
  if [ -f "$dir/cuda_runtime.h" ]; then cuda_include=$dir; break; fi
done
if [ -z "$cuda_include" ]; then
  echo "compile-check: cuda_runtime.h not found (set CUDA_HOME); CUDA glue NOT checked" >&2
  exit 1
fi
mkdir -p "$out/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
torch_includes=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
m=0
for src in csrc/*/*_cuda.cpp csrc/offload/*.cpp; do
  # shellcheck disable=SC2086
  ${CXX:-g++} -std=c++17 -w -fsyntax-only -DHASTEN_WITH_CUDA -I"$out/stub" $torch_includes -I"$cuda_include" \
    -Icsrc/include -Icsrc "$src"
  m=$((m + 1))
done
echo "compile-check: $m CUDA glue file(s) syntax-checked by the host compiler"
