#!/usr/bin/env bash
# Issue 20 (the LoRA job) on the GPU machine (one H200), in one call of at most BUDGET (560)
# seconds, most important first:
#   build   pip install -e . (carried wheels from .whl/ via scripts/gpu_parts.sh)            cap 300 s
#   gpu     $GPU_TESTS (default tests/gpu/test_lora_cuda.py: the fused LoRA op and a LoRA
#           model against PEFT), $GPU_K a -k expression (spaces allowed)                   cap $GPU_CAP (150) s
#   kernels benchmarks/dense_kernels.py at W4's and W1's shapes: each norm / RoPE / SwiGLU kernel's
#           bandwidth against a copy's, measured in the same call                            cap 90 s
#   gemm    benchmarks/gemm_shapes.py: W4's base GEMMs shape by shape                    cap 120 s
#   lora_probe  scripts/lora_grads_probe.py: the LoRA backward's one-pass kernel per tile shape
#           ($LORA_CONFIGS) against the two GEMMs, at W4's projection shapes                 cap 150 s
#   w4_configs  W4's hasten row once per HASTEN_LORA_GRADS_CONFIG in $W4_CONFIGS           cap 120 s each
#   gated_probe  scripts/lora_gated_probe.py: the gated MLP's one-pass backward against the SwiGLU
#           kernel and the two thin passes, at W4's MLP shape                                  cap 90 s
#   gated_ncu  Nsight Compute (--set full) on one launch of the gated one pass (W4's MLP shape)  cap 120 s
#   lora_ncu  Nsight Compute (--set full) on one launch of that kernel at gate/up's shape, tile shape $LORA_NCU_CONFIG (0)  cap 120 s
#   w4      benchmarks/lora_sft.py --variants $W4_VARIANTS (Llama-8B shape, LoRA r=16), with
#           $W4_ARGS (e.g. "--profile hasten")                                              cap 300 s
#   unsloth the same benchmark's unsloth variant, alone in its process, from the carried bundle
#           .whl/unsloth_offline.tar.gz (unpacked to /tmp/unsloth_site)                      cap 330 s
#   w4q     W4_Q, the 4-bit base: $W4Q_VARIANTS (hf_peft_bnb, hasten_nf4, hasten_nf4_lean)      cap 300 s
#   unsloth_nf4  Unsloth's QLoRA alone in its process                                        cap 330 s
#   w5      benchmarks/moe_lora.py (Qwen3-30B-A3B shape, $W5_LAYERS layers, LoRA on attention and
#           experts): hasten's split expert LoRA against transformers' grouped_mm + PEFT        cap 300 s
#   w5_unsloth  the same benchmark's unsloth variant, alone in its process      cap $W5_UNSLOTH_CAP (400)
#   w1      benchmarks/packed_sft.py --variants $W1_VARIANTS (W1, the dense kernels' other user) cap 300 s
#   attn    benchmarks/attention_backends.py: W1's packed attention, FlashAttention-2 and cuDNN, and
#           cuDNN over 2-4 length classes (what ragged kernels' empty tiles cost)               cap 90 s
# bitsandbytes comes from the Unsloth bundle (its CUDA 13 library only); the device image has none.
# Logs, rows and summary.txt go to $OUT/logs, packed into ONE file $OUT/issue20.tgz at the end.
#   OUT=/tmp/out HASTEN_COMMIT=<commit> PARTS="build gpu w4" bash scripts/gpu_issue20.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-560}
PARTS=" ${PARTS:-build gpu w4 unsloth} "
W4_VARIANTS=${W4_VARIANTS:-hf_peft_packed,hasten,hasten_lean,hasten_peft_layers,liger,hf_peft_padded}
STEPS=${STEPS:-4}
RUN_NAME=issue20
source scripts/gpu_parts.sh  # OUT/LOGS, part(), the summary, the carried wheels, the build part

export HASTEN_UNSLOTH_SITE=/tmp/unsloth_site
# W5's rows outlive one call (the unsloth process may run in the next call on the same warm machine)
W5_ROWS=${W5_ROWS:-/tmp/w5_rows}
mkdir -p "$W5_ROWS"

if (( built )); then
  if [[ $PARTS == *" gpu "* ]]; then
    # bitsandbytes alone from the bundle (its CUDA 13 library) for the 4-bit LoRA test, without the
    # bundle's other packages (its xformers does not load against this torch)
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import w4_unsloth; w4_unsloth.ensure_bundle('/tmp/unsloth_site')" \
      > "$LOGS/bundle.log" 2>&1 && mkdir -p /tmp/bnb_site && ln -sfn /tmp/unsloth_site/bitsandbytes /tmp/bnb_site/bitsandbytes
    # GPU_TRANSFORMERS: a transformers wheel for the tests alone (the zoo's types as CI's 5.24 has
    # them), the benchmarks keeping the image's (Unsloth caps transformers at 5.17)
    tests_site=/tmp/bnb_site
    if [[ -n "${GPU_TRANSFORMERS:-}" ]]; then
      timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_tf $GPU_TRANSFORMERS \
        >> "$LOGS/wheels.log" 2>&1 && tests_site=/tmp/site_tf:/tmp/bnb_site
    fi
    # GPU_TESTS: node ids and files, split on spaces; GPU_K: one -k expression, passed whole;
    # GPU_SHARDS: that many pytest processes side by side (scripts/pytest_shards.sh; default 1)
    runner=(python3 -m pytest)
    (( ${GPU_SHARDS:-1} > 1 )) && runner=(bash scripts/pytest_shards.sh "$GPU_SHARDS")
    # each failure's traceback written as it happens (tests/conftest.py), kept if the part times out
    HASTEN_TEST_FAILURES=$LOGS/gpu_failures.txt \
      PYTHONPATH=$tests_site${PYTHONPATH:+:$PYTHONPATH} part gpu "${GPU_CAP:-150}" "${runner[@]}" ${GPU_TESTS:-tests/gpu/test_lora_cuda.py} \
      ${GPU_K:+-k "$GPU_K"} -q -rs
    grep -E "passed|failed|skipped|^FAILED|^ERROR|Error" "$LOGS/gpu.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" kernels "* ]]; then  # the dense kernels alone against a copy, W4's and W1's shapes
    part kernels 90 bash -c "python3 benchmarks/dense_kernels.py --shape w4 --out '$LOGS' && python3 benchmarks/dense_kernels.py --shape w1 --out '$LOGS'"
    grep -E "TB/s|Error" "$LOGS/kernels.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" gemm "* ]]; then  # W4's base GEMMs one shape at a time (cuBLAS, cuBLASLt, beta 1, grouped)
    part gemm 120 python3 benchmarks/gemm_shapes.py --out "$LOGS"
    grep -E "step's|gemm_shapes|Error" "$LOGS/gemm.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w4 "* ]]; then
    part w4 300 python3 benchmarks/lora_sft.py --steps "$STEPS" --out "$LOGS" --variants "$W4_VARIANTS" ${W4_ARGS:-}
    grep -E "tok/s|FAILED|vs |Error|by group|profile" "$LOGS/w4.log" 2>/dev/null | tail -30 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" unsloth "* && -f .whl/unsloth_offline.tar.gz ]]; then
    part unsloth 330 python3 benchmarks/lora_sft.py --steps "$STEPS" --out "$LOGS" --variants unsloth
    grep -E "tok/s|FAILED|Error|unsloth" "$LOGS/unsloth.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w4q "* ]]; then  # QLoRA: the 4-bit base (needs bitsandbytes' CUDA 13 library)
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import w4_unsloth; w4_unsloth.ensure_bundle('/tmp/unsloth_site')" \
      >> "$LOGS/w4q.log" 2>&1  # bitsandbytes from the bundle
    PYTHONPATH=/tmp/unsloth_site${PYTHONPATH:+:$PYTHONPATH} part w4q 300 python3 benchmarks/lora_sft.py --steps "$STEPS" --out "$LOGS" \
      --variants "${W4Q_VARIANTS:-hf_peft_bnb,hasten_nf4,hasten_nf4_lean}"
    grep -E "tok/s|FAILED|vs |Error" "$LOGS/w4q.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" unsloth_nf4 "* && -f .whl/unsloth_offline.tar.gz ]]; then
    part unsloth_nf4 330 python3 benchmarks/lora_sft.py --steps "$STEPS" --out "$LOGS" --variants unsloth_nf4
    grep -E "tok/s|FAILED|Error|unsloth" "$LOGS/unsloth_nf4.log" 2>/dev/null | tail -20 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" w5 "* ]]; then
    part w5 300 python3 benchmarks/moe_lora.py --steps "$STEPS" --out "$W5_ROWS" --layers "${W5_LAYERS:-24}" \
      --variants "${W5_VARIANTS:-hf_grouped_mm,hasten}"
    grep -E "tok/s|FAILED|vs |Error" "$LOGS/w5.log" 2>/dev/null | tail -10 | tee -a "$SUMMARY"
    cp "$W5_ROWS"/*.jsonl "$LOGS/" 2>/dev/null
  fi
  if [[ $PARTS == *" w5_unsloth "* && -f .whl/unsloth_offline.tar.gz ]]; then
    # alone in its process; compared with the rows the w5 part left in $W5_ROWS (this call or an
    # earlier one on the same warm machine). Writes the seed-0 weights to /tmp/w5_qwen3_30b_a3b_<L>l
    # first (about 1.3 GB a layer), which later calls on a warm machine reuse.
    part w5_unsloth "${W5_UNSLOTH_CAP:-400}" python3 benchmarks/moe_lora.py --steps "$STEPS" --out "$W5_ROWS" \
      --layers "${W5_LAYERS:-24}" --variants unsloth
    grep -E "tok/s|FAILED|vs |Error|unsloth" "$LOGS/w5_unsloth.log" 2>/dev/null | tail -12 | tee -a "$SUMMARY"
    cp "$W5_ROWS"/*.jsonl "$LOGS/" 2>/dev/null
  fi
  if [[ $PARTS == *" w1 "* ]]; then
    part w1 300 python3 benchmarks/packed_sft.py --steps 10 --out "$LOGS" --variants "${W1_VARIANTS:-hasten,liger}"
    grep -E "tok/s|FAILED|vs |Error" "$LOGS/w1.log" 2>/dev/null | tail -10 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" attn "* ]]; then
    part attn 90 python3 benchmarks/attention_backends.py --out "$LOGS"
    grep -E "ms fwd|failed|Error" "$LOGS/attn.log" 2>/dev/null | tail -10 | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" lora_probe "* ]]; then  # the LoRA backward's one-pass kernel, tile shapes at W4's shapes
    part lora_probe 150 python3 scripts/lora_grads_probe.py --configs "${LORA_CONFIGS:-0,4}"
    grep -E "config|GEMMs|Error" "$LOGS/lora_probe.log" 2>/dev/null | tee -a "$SUMMARY"
  fi
  if [[ $PARTS == *" gated_probe "* ]]; then  # the gated MLP's one pass against the SwiGLU kernel + thin passes
    part gated_probe 90 python3 scripts/lora_gated_probe.py
  fi
  if [[ $PARTS == *" lora_ncu "* ]]; then  # Nsight Compute on one launch of that kernel (gate/up's shape)
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
    if [[ -n "$ncu_bin" ]]; then
      part lora_ncu 120 "$ncu_bin" --kernel-name regex:lora_grads_kernel --launch-skip 3 --launch-count 1 --set full \
        python3 scripts/lora_grads_probe.py --configs "${LORA_NCU_CONFIG:-0}" --shape 4096,14336
      grep -E "Throughput|Bandwidth|Warp Cycles|Issue|Occupancy|Stall|Bank|Duration" "$LOGS/lora_ncu.log" | head -40 \
        | tee -a "$SUMMARY"
    else
      echo "lora_ncu: no ncu on this machine" | tee -a "$SUMMARY"
    fi
  fi
  if [[ $PARTS == *" gated_ncu "* ]]; then  # Nsight Compute on one launch of the gated MLP's one pass
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
    if [[ -n "$ncu_bin" ]]; then
      part gated_ncu 120 "$ncu_bin" --kernel-name regex:lora_gated_grads_kernel --launch-skip 3 --launch-count 1 \
        --set full python3 scripts/lora_gated_probe.py
      grep -E "Throughput|Bandwidth|Warp Cycles|Issue|Occupancy|Stall|Bank|Duration" "$LOGS/gated_ncu.log" | head -40 \
        | tee -a "$SUMMARY"
    else
      echo "gated_ncu: no ncu on this machine" | tee -a "$SUMMARY"
    fi
  fi
  if [[ $PARTS == *" w4_configs "* ]]; then  # W4's hasten row under each HASTEN_LORA_GRADS_CONFIG in W4_CONFIGS
    for c in ${W4_CONFIGS:-0 4}; do
      HASTEN_LORA_GRADS_CONFIG=$c part "w4_config$c" 120 python3 benchmarks/lora_sft.py --steps "$STEPS" \
        --out "$LOGS/config$c" --variants hasten
      grep -E "tok/s" "$LOGS/w4_config$c.log" 2>/dev/null | sed "s/^/config $c: /" | tee -a "$SUMMARY"
    done
  fi
fi

stop_clock_sampler
echo "total $(( SECONDS - START )) s" | tee -a "$SUMMARY"
tar czf "$OUT/issue20.tgz" -C "$OUT" logs && rm -rf "$LOGS" && echo "packed: $OUT/issue20.tgz" \
  || echo "tar failed: the logs stay in $LOGS"
