#!/usr/bin/env bash
# Issue 16 part 3 on the GPU machine (one H200), in one call of at most BUDGET (530) seconds, in
# this order (what matters most first; a part gets at most its cap and never more than is left):
#   build     pip install -e . (wheels in .whl/ go to /tmp/site first, as in gpu_check.sh)     cap 300 s
#   gpu       tests/gpu/test_cuda_graphs_cuda.py (GraphedAdamW, the captured MoE block), -s     cap 120 s
#             (GPU_TESTS: other pytest arguments, e.g. the fused head norm + rotary's tests;
#             GPU_CAP: another cap in seconds)
#   kernels   benchmarks/dense_kernels.py --shape w1 (each dense kernel at W1's shapes, the
#             fused head norm + rotary against the two kernels it replaces)                  cap 60 s
#   attention benchmarks/attention_backends.py (W1_attention: cuDNN with native and repeated
#             K/V heads, FlashAttention-2)                                                   cap 90 s
#   w3        W3 --steps 10: hf_moe_grouped_mm, hasten_fused, hasten_graphed,
#             hasten_graphed_callables, hasten_compiled                                      cap 150 s
#   w1        W1 --steps 10: hasten, hasten_graphed_optimizer, hasten_compiled (W1_VARIANTS: others; W1_ARGS: more
#             arguments, e.g. --profile hasten), liger (last: it
#             patches transformers' Qwen3 for the rest of the process; where liger_kernel imports)
#   job       benchmarks/default_job.py: the embedded default job (make train's) eager, compiled,
#             graphed optimizer, both, step graphs, and hasten off; 30 steps each (JOB_ARGS)  cap 300 s
#   ops       tests/ops, and tests/integrations/test_compile.py when it exists (mostly CPU tests:
#             last, with the time that is left)                                              cap 90 s
# Each part's log, rc and seconds go to $OUT/logs/summary.txt (key lines too); benchmark rows are
# written per variant, so a part cut short keeps the rows it finished. At the end everything is
# packed into ONE file, $OUT/issue16.tgz, and the loose files are removed.
# Estimates (fresh machine, benchmarks/results/gpu-*): build 145-175 s, gpu ~60 s, w3 ~90 s
# (torch.compile of the block ~40 s), w1 ~170 s (of it ~120 s compiling the layers, eval and
# train), ops ~30 s: about 520 s.
#   OUT=/tmp/out HASTEN_COMMIT=<commit> bash scripts/gpu_issue16.sh      (PARTS="gpu w3" for a subset)
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-530}
PARTS=" ${PARTS:-build gpu w3 w1 ops} "  # kernels, attention, job: asked for by name
RUN_NAME=issue16
source scripts/gpu_parts.sh  # OUT/LOGS, part(), the summary, the carried wheels, the build part

if (( built )); then
  if [[ $PARTS == *" gpu "* ]]; then
    # shellcheck disable=SC2086  # GPU_TESTS holds several pytest arguments
    part gpu "${GPU_CAP:-120}" python3 -m pytest ${GPU_TESTS:-tests/gpu/test_cuda_graphs_cuda.py} -q -rs -s
    grep -E "graphed vs eager|replay [0-9]|make_graphed_callables|eager losses|graphed losses|optimizer_graph|passed|failed|skipped|^FAILED|^ERROR|worst_of_allowed" \
      "$LOGS/gpu.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" kernels "* ]]; then
    part kernels 60 python3 benchmarks/dense_kernels.py --shape w1 --out "$LOGS"
    grep -E "norm|rope|copy|Error" "$LOGS/kernels.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" attention "* ]]; then
    part attention 90 python3 benchmarks/attention_backends.py --out "$LOGS"
    grep -E "ms fwd\+bwd|fell back|Error" "$LOGS/attention.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w3 "* ]]; then
    part w3 150 python3 benchmarks/moe_block.py --steps 10 --out "$LOGS" \
      --variants hf_moe_grouped_mm,hasten_fused,hasten_graphed,hasten_graphed_callables,hasten_compiled
    grep -E "^ +W3|vs eager hasten_fused|x$|FAILED|Error" "$LOGS/w3.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w1 "* ]]; then
    W1_VARIANTS=${W1_VARIANTS:-hasten,hasten_graphed_optimizer,hasten_compiled}
    timeout 60 python3 -c "import liger_kernel" 2>/dev/null && W1_VARIANTS=$W1_VARIANTS,liger
    # shellcheck disable=SC2086  # W1_ARGS: further arguments, e.g. --profile hasten
    part w1 330 python3 benchmarks/packed_sft.py --steps 10 --out "$LOGS" --variants "$W1_VARIANTS" ${W1_ARGS:-}
    grep -E "tok/s|FAILED|vs |compiled graphs|optimizer graph|losses vs|by group|^profile" "$LOGS/w1.log" 2>/dev/null | tail -16 \
      | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" job "* ]]; then
    # shellcheck disable=SC2086  # JOB_ARGS: further arguments, e.g. --steps 50
    part job 300 python3 benchmarks/default_job.py --out "$LOGS" ${JOB_ARGS:-}
    grep -E "tok/s|vs eager|ERROR|Error" "$LOGS/job.log" 2>/dev/null | grep -v "^step" | tail -12 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" ops "* ]]; then
    OPS_TESTS="tests/ops"
    [ -f tests/integrations/test_compile.py ] && OPS_TESTS="$OPS_TESTS tests/integrations/test_compile.py"
    part ops 90 python3 -m pytest $OPS_TESTS -q -rs
    grep -E "passed|failed|skipped|^FAILED|^ERROR" "$LOGS/ops.log" 2>/dev/null | tail -12 | tee -a "$SUMMARY"
  fi
fi

stop_clock_sampler
echo "total $(( SECONDS - START )) s" | tee -a "$SUMMARY"
tar czf "$OUT/issue16.tgz" -C "$OUT" logs && rm -rf "$LOGS" && echo "packed: $OUT/issue16.tgz" \
  || echo "tar failed: the logs stay in $LOGS"
