#!/usr/bin/env bash
# On the GPU machine: build for sm_90 (unless SKIP_BUILD=1), then the parts named in PARTS
# (default: all), writing one log ($OUT/features${TAG}.log) and the benchmark rows ($OUT/W*.jsonl):
# the device returns at most 8 files per call. On a two-GPU machine run two of these at once,
# each with its own CUDA_VISIBLE_DEVICES and TAG, after one build.
#   tests  every GPU test (tests/gpu)
#   w1     W1 with every kernel off, the defaults, FlashAttention-2 attention, and Liger-Kernel where it
#          imports (carry its wheel); one profiled step of the defaults
#   w2     W2 (activation memory), all variants but save_on_cpu
#   attn   packed attention backends on W1's shapes (FlashAttention-2 varlen vs cuDNN ragged)
#   moe    W3 (MoE block) and the grouping op alone
#   long   W2's long-context anchor (Llama-8B shape + LoRA, longest sequence)
# Budget: build ~1.5 min, tests ~2 min, w1 ~2 min, w2 ~3 min, moe ~1 min, long ~6 min; one call
# runs at most 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
LOG="$OUT/features${TAG:-}.log"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
PARTS=" ${PARTS:-tests w1 w2 long} "
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . >> "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
fi
if [[ $PARTS == *" tests "* ]]; then
  python3 -m pytest tests/gpu -q -rs -s >> "$LOG" 2>&1
  grep -E "passed|failed|^FAILED" "$LOG" | tail -15
fi
if [[ $PARTS == *" attn "* ]]; then
  python3 benchmarks/attention_backends.py --out "$OUT" >> "$LOG" 2>&1
  grep -E "fwd\+bwd|failed|fell back" "$LOG" | tail -6
fi
if [[ $PARTS == *" w1 "* ]]; then
  W1_VARIANTS=${W1_VARIANTS:-hasten_unfused,hasten,hasten_fa2}
  python3 -c "import liger_kernel" 2>/dev/null && W1_VARIANTS=$W1_VARIANTS,liger  # last: it patches globally
  python3 benchmarks/packed_sft.py --steps 5 --out "$OUT" --variants "$W1_VARIANTS" --profile hasten \
    >> "$LOG" 2>&1
  grep -E "tok/s|^profile|by group" "$LOG" | tail -9
fi
if [[ $PARTS == *" w2 "* ]]; then
  python3 benchmarks/activation_memory.py --iters 3 --out "$OUT" --variants \
    hf_no_ckpt,hf_grad_ckpt,hasten_selective,hasten_offload_all,hasten_offload_auto,hasten_offload_budget,hasten_fused_ce,hasten_fused_ce_auto,hasten \
    >> "$LOG" 2>&1
  grep -E "^ +W2 |x no-ckpt|offload plan" "$LOG" | tail -22
fi
if [[ $PARTS == *" moe "* ]]; then
  python3 benchmarks/moe_block.py --out "$OUT" >> "$LOG" 2>&1
  grep -E "ms|syncs|x " "$LOG" | tail -8
fi
if [[ $PARTS == *" long "* ]]; then
  python3 benchmarks/long_context.py --out "$OUT" >> "$LOG" 2>&1
  grep -E "tokens:|longest" "$LOG" | tail -20
fi
