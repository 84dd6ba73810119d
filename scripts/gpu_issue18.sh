#!/usr/bin/env bash
# Issue 18 (MoE and MLA families) on the GPU machine (one H200), in one call of at most BUDGET (560)
# seconds, most important first:
#   build   pip install -e . (carried wheels from .whl/ via scripts/gpu_parts.sh)            cap 300 s
#   gpu     $GPU_TESTS (default: the zoo's GPU parity, gpt-oss's sinks on cuDNN, the MoE GPU tests)
#                                                                                          cap 200 s
#   w3      benchmarks/moe_block.py for each block in $W3_BLOCKS (gpt_oss_20b deepseek_v2_lite
#           llama4_scout qwen3_30b_a3b): hasten_fused against transformers' grouped_mm (Llama 4:
#           against its block's own forward), 16,384 tokens                                  cap 120 s each
#           (W3_ARGS: more options, e.g. --profile hasten_fused)
#   router  benchmarks/moe_router.py: one router's forward + backward, the model's against hasten's
#           fused one, GPU and host microseconds (rows W3_router.jsonl)                      cap 120 s
#   ggprobe scripts/grouped_gemm_probe.py: the experts' six grouped GEMMs of W3's blocks per CUTLASS
#           sm90 configuration against torch._grouped_mm (CUTLASS's headers from
#           .whl/cutlass-include.txz, unpacked to /tmp/cutlass; the TUs built in parallel) cap 400 s
#           (HASTEN_GG_PROBE_CONFIGS: a subset; HASTEN_GG_PROBE_FLAGS=both: also built with hasten's
#           build flags; hasten's own op is timed too where the build has its CUTLASS kernels)
#   gptoss  benchmarks/packed_sft.py --model gpt_oss_20b (4 of 24 layers, full fine-tuning):
#           hasten packed against transformers' padded micro-batches (eager attention with the
#           sinks, grouped_mm experts); rows W1-gpt_oss_20b.jsonl                  cap $GPTOSS_CAP (300)
# Logs, rows and summary.txt go to $OUT/logs, packed into ONE file $OUT/issue18.tgz at the end.
#   OUT=/tmp/out HASTEN_COMMIT=<commit> PARTS="build gpu w3" bash scripts/gpu_issue18.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-560}
PARTS=" ${PARTS:-build gpu w3} "
RUN_NAME=issue18
source scripts/gpu_parts.sh  # OUT/LOGS, part(), the summary, the carried wheels, the build part

if (( built )); then
  if [[ $PARTS == *" gpu "* ]]; then
    part gpu "${GPU_CAP:-200}" python3 -m pytest ${GPU_TESTS:-tests/gpu/test_model_parity_cuda.py tests/gpu/test_attention_cuda.py tests/gpu/test_moe_cuda.py} -q -rs
    grep -E "passed|failed|skipped|^FAILED|^ERROR|Error" "$LOGS/gpu.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" router "* ]]; then
    # the model's router against hasten's fused one (training.moe.fused_router), GPU and host time
    part router 120 python3 benchmarks/moe_router.py --out "$LOGS" ${ROUTER_ARGS:-}
    grep -E "us GPU|Error" "$LOGS/router.log" 2>/dev/null | tail -12 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" ggprobe "* ]]; then
    export MAX_JOBS=16  # CUTLASS's headers: unpacked by gpu_parts.sh to HASTEN_CUTLASS_DIR
    part ggprobe "${GGPROBE_CAP:-400}" python3 scripts/grouped_gemm_probe.py --out "$LOGS"
    grep -E "built|torch|GEMMs|Error|error" "$LOGS/ggprobe.log" 2>/dev/null | tail -30 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w3 "* ]]; then
    for block in ${W3_BLOCKS:-gpt_oss_20b deepseek_v2_lite llama4_scout qwen3_30b_a3b}; do
      # Llama 4's block has no grouped_mm experts: its own forward (every expert) is the baseline
      baseline=hf_moe_grouped_mm; [[ $block == llama4_scout ]] && baseline=hf_moe_eager
      part "w3_$block" 120 python3 benchmarks/moe_block.py --block "$block" --out "$LOGS" --no-grouping \
        --variants "${W3_VARIANTS:-$baseline,hasten_fused}" ${W3_ARGS:-}
      grep -E "ms |FAILED|Error" "$LOGS/w3_$block.log" 2>/dev/null | tail -6 | tee -a "$SUMMARY"
    done
  fi
  if [[ $PARTS == *" gptoss "* ]]; then
    # the whole-model row: gpt-oss-20b's shape, 4 of its 24 layers (GPTOSS_ARGS: --layers N), full
    # fine-tuning on W1's 16,384-token batch, hasten packed against transformers' padded micro-batches
    part gptoss "${GPTOSS_CAP:-300}" python3 benchmarks/packed_sft.py --model gpt_oss_20b --variants hf_padded,hasten \
      --steps 3 --out "$LOGS" ${GPTOSS_ARGS:-}
    grep -E "tok/s|x tokens|FAILED|Error" "$LOGS/gptoss.log" 2>/dev/null | tail -6 | tee -a "$SUMMARY"
  fi
fi

stop_clock_sampler
echo "total $(( SECONDS - START )) s" | tee -a "$SUMMARY"
tar czf "$OUT/issue18.tgz" -C "$OUT" logs && rm -rf "$LOGS" && echo "packed: $OUT/issue18.tgz" \
  || echo "tar failed: the logs stay in $LOGS"
