#!/usr/bin/env bash
# Issue 19 (packed training of hybrid linear-attention models) on the GPU machine (one H200), in one
# call of at most BUDGET (570) seconds, most important first. Carry .whl/: fla_tilelang.tar.xz
# (scripts/fla_bundle.sh: flash-linear-attention 0.6.0 with TileLang, which fla needs on Hopper with
# torch 2.11's Triton 3.6) and nvidia-cudnn-frontend's wheel (the cuDNN attention op); the image's
# transformers 5.17 has every hybrid type of the table, but its Lfm2ShortConv takes no keyword
# arguments (LFM2 packed is refused there), and lfm2_moe, lfm3 and lara_mini are 5.24's:
# .whl/transformers_pruned.tar.xz (1.5 MB) runs them on 5.24, with the other types new in 5.24:
#   bash scripts/transformers_bundle.sh 5.24.0 lfm2 qwen3_next qwen3_5 qwen3_5_moe olmo_hybrid \
#     llama4 ministral3 granite_swa hyperclovax youtu gpt_neox phi stablelm hy_v3 mimo_v2_flash \
#     laguna granitemoe_swa lfm2_moe lfm3 lara_mini qwen4_exp mistral3 qwen3_moe gpt_oss \
#     deepseek_v2 phi3 phimoe jais2 nanochat hrm_text mellum kolibri1 flint minicpm3 axk1 \
#     gemma4_unified jetmoe dbrx zaya axk2 deepseek_v32 deepseek_v4 llama exaone iquestcoder glm4_moe \
#     sarvam_moe deepseek_v3 sarvam_mla bitnet gpt2 gpt_bigcode gptj codegen opt biogpt apertus \
#     apertus1p5 cohere_compass aria longcat_flash diffllama kimi_linear
# (types mapped to another type's classes, sarvam_moe to glm4_moe's, need that folder named too)
# (a type left out of the bundle fails to import in that call). A cold machine compiles and autotunes
# fla's Triton and TileLang kernels once per head shape: at fac8d45 the GPU tests took 145 s cold on
# 5.17, over 240 s cold on 5.24 (grouped value heads, another shape) and 51 s warm.
#   build   pip install -e . (carried wheels from .whl/ via scripts/gpu_parts.sh)            cap 300 s
#   probe   scripts/fla_probe.py: fla's varlen kernels against transformers' torch functions  cap 90 s
#   gpu     $GPU_TESTS (default: the zoo's GPU parity and the linear-attention GPU tests), -k $GPU_K
#                                                                                          cap $GPU_CAP (240)
#   w6      benchmarks/hybrid_sft.py (W6): hasten packed against transformers' padded micro-batches
# Logs, rows and summary.txt go to $OUT/logs, packed into ONE file $OUT/issue19.tgz at the end.
#   OUT=/tmp/out HASTEN_COMMIT=<commit> PARTS="build probe gpu w6" bash scripts/gpu_issue19.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-570}
PARTS=" ${PARTS:-build probe gpu w6} "
RUN_NAME=issue19
source scripts/gpu_parts.sh  # OUT/LOGS, part(), the summary, the carried wheels, the build part

if [[ $PARTS == *" probe "* ]]; then
  part probe "${PROBE_CAP:-90}" python3 scripts/fla_probe.py
  grep -E "^fla|vs fp32|noise|mixed|sync|ms$|Error" "$LOGS/probe.log" 2>/dev/null | tail -12 | tee -a "$SUMMARY"
fi
if (( built )); then
  if [[ $PARTS == *" gpu "* ]]; then
    HASTEN_PARITY_REPORT="$LOGS/parity.jsonl" part gpu "${GPU_CAP:-240}" python3 -m pytest \
      ${GPU_TESTS:-tests/gpu/test_model_parity_cuda.py tests/gpu/test_linear_attention_cuda.py} ${GPU_K:+-k "$GPU_K"} \
      -q -rs --durations=15
    grep -E "passed|failed|skipped|^FAILED|^ERROR|Error" "$LOGS/gpu.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w6 "* ]]; then
    part w6 "${W6_CAP:-200}" python3 benchmarks/hybrid_sft.py --out "$LOGS" ${W6_ARGS:-}
    grep -E "tok/s|x |FAILED|Error" "$LOGS/w6.log" 2>/dev/null | tail -10 | tee -a "$SUMMARY"
  fi
fi

stop_clock_sampler
echo "total $(( SECONDS - START )) s" | tee -a "$SUMMARY"
tar czf "$OUT/issue19.tgz" -C "$OUT" logs && rm -rf "$LOGS" && echo "packed: $OUT/issue19.tgz" \
  || echo "tar failed: the logs stay in $LOGS"
