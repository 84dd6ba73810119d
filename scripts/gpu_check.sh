#!/usr/bin/env bash
# On the GPU machine: build for sm_90, doctor, all tests (CPU + tests/gpu), the W1 benchmark,
# and the embedded default job. Logs and benchmark rows go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# The GPU machine has no network: wheels carried in .whl/ (nvidia-cudnn-frontend for the cuDNN
# attention op's headers, liger-kernel and trl for comparisons) go to /tmp/site before the build.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep "hasten: " "$OUT/build.log" | sort -u  # which ops were built (the cuDNN attention op needs the frontend headers)
python3 -m hasten doctor 2>&1 | tee "$OUT/doctor.log"
python3 -m pytest ${TESTS:-tests} -q -rs 2>&1 | tee "$OUT/tests.log" | tail -15
python3 -m pytest tests/gpu -q -s -k "host_syncs or loss_curve" 2>&1 | grep -E "host syncs|^padded|^packed" | tee -a "$OUT/tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/packed_sft.py --out "$OUT" 2>&1 | tee "$OUT/w1.log"
fi
python3 -m hasten train --output_dir /tmp/hasten-default --max_steps 20 --no_progress 2>&1 | tail -6 | tee "$OUT/train.log"
