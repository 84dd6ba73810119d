#!/usr/bin/env bash
# Issue 17 (the model table, GeGLU, partial/interleaved RoPE) on the GPU machine (one H200), in one
# call of at most BUDGET (560) seconds, most important first:
#   build   pip install -e . (carried wheels from .whl/ via scripts/gpu_parts.sh)            cap 300 s
#   gpu     tests/gpu/test_dense_cuda.py (the new kernels against torch), test_attention_cuda.py and
#           tests/gpu/test_model_parity_cuda.py (every zoo type, bf16 vs fp32 one sample at a
#           time; one JSON row per type in logs/parity.jsonl)                              cap 240 s
#   w1      benchmarks/packed_sft.py --model M for each M in $MODELS (default gemma3_1b):
#           hasten, hasten_unfused and liger (where liger_kernel imports) in one run, with
#           $W1_ARGS (e.g. "--profile hasten")                                              cap 330 s
#   attn    benchmarks/attention_backends.py (W1's attention shapes; the softcap row)         cap 60 s
#   ops     tests/ops (mostly CPU)                                                         cap 90 s
# Logs, rows and summary.txt go to $OUT/logs, packed into ONE file $OUT/issue17.tgz at the end.
#   OUT=/tmp/out HASTEN_COMMIT=<commit> PARTS="build gpu" bash scripts/gpu_issue17.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-560}
PARTS=" ${PARTS:-build gpu w1 ops} "
MODELS=${MODELS:-gemma3_1b}
STEPS=${STEPS:-6}
RUN_NAME=issue17
source scripts/gpu_parts.sh  # OUT/LOGS, part(), the summary, the carried wheels, the build part

if (( built )); then
  if [[ $PARTS == *" gpu "* ]]; then
    HASTEN_PARITY_REPORT="$LOGS/parity.jsonl" part gpu 240 python3 -m pytest tests/gpu/test_dense_cuda.py tests/gpu/test_attention_cuda.py \
      tests/gpu/test_model_parity_cuda.py -q -rs
    grep -E "passed|failed|skipped|^FAILED|^ERROR" "$LOGS/gpu.log" 2>/dev/null | tail -40 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" attn "* ]]; then
    part attn 60 python3 benchmarks/attention_backends.py --out "$LOGS"
    grep -E "ms fwd|failed|fell back" "$LOGS/attn.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w1 "* ]]; then
    VARIANTS=hasten,hasten_unfused
    timeout 60 python3 -c "import liger_kernel" 2>/dev/null && VARIANTS=$VARIANTS,liger
    for model in $MODELS; do
      part "w1-$model" 330 python3 benchmarks/packed_sft.py --model "$model" --steps "$STEPS" --out "$LOGS" \
        --variants "$VARIANTS" ${W1_ARGS:-}
      grep -E "tok/s|FAILED|vs |Error|ms " "$LOGS/w1-$model.log" 2>/dev/null | tail -30 | tee -a "$SUMMARY"
    done
  fi
  if [[ $PARTS == *" ops "* ]]; then
    part ops 90 python3 -m pytest tests/ops -q -rs
    grep -E "passed|failed|skipped|^FAILED|^ERROR" "$LOGS/ops.log" 2>/dev/null | tail -12 | tee -a "$SUMMARY"
  fi
fi

stop_clock_sampler
echo "total $(( SECONDS - START )) s" | tee -a "$SUMMARY"
tar czf "$OUT/issue17.tgz" -C "$OUT" logs && rm -rf "$LOGS" && echo "packed: $OUT/issue17.tgz" \
  || echo "tar failed: the logs stay in $LOGS"
