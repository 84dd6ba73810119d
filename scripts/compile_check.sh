#!/usr/bin/env bash
# No GPU needed. 1) Every torch-free CUDA kernel (csrc/kernels/*.cu) compiled with nvcc for
# sm_80 and sm_90. 2) The torch-facing CUDA glue (csrc/*/*_cuda.cpp) syntax-checked by the host
# compiler against the installed torch's headers (a CPU wheel lacks one generated header,
# c10/cuda/impl/cuda_cmake_macros.h, which is stood in for here).
#
# nvcc is looked for where torch's extension build looks for the CUDA toolkit: $CUDA_HOME/bin
# (or $CUDA_PATH/bin) when set, else PATH, else /usr/local/cuda/bin. Without nvcc the check is skipped with a NOTICE and exit 0 (`make test` on
# a machine without the CUDA toolkit), unless HASTEN_REQUIRE_COMPILE_CHECK=1 (CI, .ci/run): then
# a missing nvcc is an error, so the check cannot drop out of CI unnoticed.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda_root=${CUDA_HOME:-${CUDA_PATH:-}}
if [ -n "$cuda_root" ]; then
  nvcc=$cuda_root/bin/nvcc
  [ -x "$nvcc" ] || nvcc=""
  looked="$cuda_root/bin (CUDA_HOME/CUDA_PATH)"
else
  nvcc=$(command -v nvcc 2>/dev/null || true)
  if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
  looked="PATH and /usr/local/cuda/bin"
fi
case "${HASTEN_REQUIRE_COMPILE_CHECK:-0}" in
  1 | true | yes | on) required=1 ;;
  0 | false | no | off | "") required=0 ;;
  *) echo "compile-check: HASTEN_REQUIRE_COMPILE_CHECK must be 1 or 0, got '$HASTEN_REQUIRE_COMPILE_CHECK'" >&2
     exit 2 ;;
esac
if [ -z "$nvcc" ]; then
  what="the CUDA kernels (csrc/kernels/*.cu, sm_80 and sm_90) and the CUDA glue (csrc/*/*_cuda.cpp)"
  how="install the CUDA toolkit (nvcc on PATH, or set CUDA_HOME), then run: make compile-check"
  if [ "$required" = 1 ]; then
    echo "compile-check: FAILED: nvcc not found in $looked, and HASTEN_REQUIRE_COMPILE_CHECK=1 requires" \
      "the check; $what were NOT compile-checked. Fix: $how" >&2
    exit 1
  fi
  echo "NOTICE: compile-check SKIPPED: nvcc not found in $looked, so $what were NOT compile-checked" \
    "(the CPU tests do not need it; CI requires it). To run it: $how" >&2
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# One nvcc per (file, arch), as many at once as there are cores (sequential, the check took 3 of
# CI's 18 minutes on two cores); each one's messages are printed after all have run, a failure
# fails the check with its log.
for src in csrc/kernels/*.cu; do
  for arch in 80 90; do printf '%s %s\n' "$src" "$arch"; done
done | NVCC=$nvcc OUT=$out xargs -P "$(nproc 2>/dev/null || echo 2)" -L 1 sh -c '
  log="$OUT/$(basename "$0").sm$1.log"
  "$NVCC" -std=c++17 -O3 -Xptxas -warn-spills -gencode "arch=compute_$1,code=sm_$1" -Icsrc/include -c "$0" \
    -o "$OUT/$(basename "$0").sm$1.o" > "$log" 2>&1 || echo "$0 (sm_$1)" >> "$OUT/failed"'
n=$(printf '%s\n' csrc/kernels/*.cu | wc -l)
cat "$out"/*.sm*.log >&2
if [ -f "$out/failed" ]; then
  echo "compile-check: FAILED: nvcc could not compile: $(tr '\n' ' ' < "$out/failed")(messages above)" >&2
  exit 1
fi
echo "compile-check: $n CUDA kernel file(s) compiled for sm_80 and sm_90"

# The experts' grouped GEMM kernels (CUTLASS, sm_90a), where CUTLASS's headers are found as
# setup.py finds them; ptxas's C7510 (WGMMA serialised: a call inside the mainloop) fails the check.
cutlass=$(python3 - <<'PY' 2>/dev/null
import importlib.util, os
root = os.environ.get("HASTEN_CUTLASS_DIR")
if root:
    found = [os.path.join(root, "include"), root]
else:
    spec = importlib.util.find_spec("cutlass_library")
    found = [os.path.join(list(spec.submodule_search_locations)[0], "source", "include")] if spec else []
print(next((d for d in found if os.path.exists(os.path.join(d, "cutlass", "cutlass.h"))), ""))
PY
)
if [ -n "$cutlass" ]; then
  g=0
  for src in csrc/kernels/grouped_gemm_sm90/*.cu; do
    log="$out/$(basename "$src").log"
    "$nvcc" -std=c++17 -O3 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ -Xptxas -warn-spills \
      -gencode arch=compute_90a,code=sm_90a -I"$cutlass" -c "$src" -o "$out/$(basename "$src").o" 2>"$log" \
      || { cat "$log" >&2; exit 1; }
    if grep -q "C7510" "$log"; then
      echo "compile-check: FAILED: $src: ptxas serialised the WGMMA pipeline (C7510); see the log below" >&2
      cat "$log" >&2
      exit 1
    fi
    g=$((g + 1))
  done
  echo "compile-check: $g grouped GEMM file(s) compiled for sm_90a against CUTLASS ($cutlass)"
else
  echo "NOTICE: compile-check: CUTLASS's headers not found (pip install nvidia-cutlass, or set HASTEN_CUTLASS_DIR):" \
    "the grouped GEMM kernels (csrc/kernels/grouped_gemm_sm90) were NOT compile-checked" >&2
fi

cuda_include=""
for dir in "${cuda_root:+$cuda_root/include}" "$(dirname "$(dirname "$nvcc")")/include" /usr/local/cuda/include; do
  if [ -f "$dir/cuda_runtime.h" ]; then cuda_include=$dir; break; fi
done
if [ -z "$cuda_include" ]; then
  echo "compile-check: cuda_runtime.h not found (set CUDA_HOME); CUDA glue NOT checked" >&2
  exit 1
fi
mkdir -p "$out/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
torch_includes=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
# as many at once as there are cores, as the kernels above
printf '%s\n' csrc/*/*_cuda.cpp csrc/offload/*.cpp | CXX=${CXX:-g++} OUT=$out FLAGS="-std=c++17 -w -fsyntax-only \
  -DHASTEN_WITH_CUDA -DHASTEN_WITH_CUTLASS -I$out/stub $torch_includes -I$cuda_include -Icsrc/include -Icsrc" \
  xargs -P "$(nproc 2>/dev/null || echo 2)" -L 1 sh -c '
  log="$OUT/$(basename "$0").glue.log"
  # shellcheck disable=SC2086
  $CXX $FLAGS "$0" > "$log" 2>&1 || echo "$0" >> "$OUT/glue_failed"'
m=$(printf '%s\n' csrc/*/*_cuda.cpp csrc/offload/*.cpp | wc -l)
if [ -f "$out/glue_failed" ]; then
  cat "$out"/*.glue.log >&2
  echo "compile-check: FAILED: the host compiler rejected: $(tr '\n' ' ' < "$out/glue_failed")(messages above)" >&2
  exit 1
fi
echo "compile-check: $m CUDA glue file(s) syntax-checked by the host compiler"
