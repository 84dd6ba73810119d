#!/usr/bin/env bash
# On the GPU machine, after the extension is built: the production-training runs of the closing
# notes. Results go to $OUT (or ./gpu-out).
#   bench    hasten bench (hasten off vs on) on the Qwen3-0.6B-shaped job, one GPU
#   wrapper  (1 GPU, not in the default PARTS) the plain loop vs FSDP2 (UNITS layers per unit) and DDP
#            over one process under torchrun: the wrappers' own cost, and each run's host lead
#   scaling  (2+ GPUs) one GPU vs torchrun FSDP2 on two (default units, kept gathered, a unit per
#            layer), same config, tokens/s and losses over SCALE_STEPS (80) steps of ACCUM (1)
#            micro-batches; the collectives' bandwidth first
#   resume   (2+ GPUs) FSDP2 killed (SIGKILL, whole job) after a checkpoint, then --resume auto;
#   elastic  (2+ GPUs) one worker killed under torchrun --max-restarts 1; the restarted workers
#            resume from the latest checkpoint
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
CONFIG=${CONFIG:-configs/qwen3_0.6b_shape.yaml}
STEPS=${STEPS:-30}
RUNS=${RUNS:-/tmp/hasten-runs}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $GPUS"

if [[ " ${PARTS:-bench scaling resume elastic} " == *" bench "* ]]; then
  python3 -m hasten bench --config "$CONFIG" --steps "$STEPS" --output_dir "$RUNS/bench" --no_progress \
    > "$OUT/bench.log" 2>&1; echo "bench exit $?" | tee -a "$OUT/bench.log"
  tail -25 "$OUT/bench.log"
  cp "$RUNS"/bench/bench.json "$RUNS"/bench/bench.png "$OUT/" 2>/dev/null
fi

SCALE_STEPS=${SCALE_STEPS:-80} ACCUM=${ACCUM:-1}
scaling_configs() {
  # Steady state: a row every 10 steps (a per-step row costs each step a host sync), checkpoints every
  # 50 (their writing time is reported apart from the step rate), the first row left out as warm-up.
  # ACCUM micro-batches per optimizer step (gradients reduced once per step), the same on one GPU.
  python3 - "$CONFIG" "$RUNS" "$ACCUM" "${LOG_EVERY:-10}" "${PROFILE_STEP:-0}" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
if int(sys.argv[5]):  # torch.profiler on that optimizer step: LOG_DIR/profile_step<N>_rank<R>.txt
    config.setdefault("logging", {})["profile_step"] = int(sys.argv[5])
training = config.setdefault("training", {})
training["gradient_accumulation_steps"] = int(sys.argv[3])
training["logging_steps"] = int(sys.argv[4])
training.setdefault("checkpoint", {})["interval_steps"] = 50
yaml.safe_dump(config, open(f"{sys.argv[2]}/scaling.yaml", "w"))
training["fsdp2_reshard_after_forward"] = False  # each unit's gathered weights kept from forward to backward
yaml.safe_dump(config, open(f"{sys.argv[2]}/keep_gathered.yaml", "w"))
training["fsdp2_reshard_after_forward"] = True
training["fsdp2_layers_per_unit"] = 1  # the earlier default: a unit per decoder layer
yaml.safe_dump(config, open(f"{sys.argv[2]}/unit_per_layer.yaml", "w"))
PY
}

if [[ " ${PARTS:-bench scaling resume elastic} " == *" wrapper "* ]]; then
  # One GPU: the plain loop against the same config under torchrun --nproc_per_node 1 (a group of
  # one: the wrapper's hooks, copies and host work without a second rank or a link), FSDP2 with
  # UNITS layers per unit each (0: auto), and DDP; each run's host lead (near 0 ms: the GPU waits for the host).
  scaling_configs
  CUDA_VISIBLE_DEVICES=0 python3 -m hasten train --config "$RUNS/scaling.yaml" --max_steps "$SCALE_STEPS" \
    --output_dir "$RUNS/w_plain" --no_progress > "$OUT/wrapper_plain.log" 2>&1; echo "plain exit $?"
  compared=(plain="$RUNS/w_plain/logs")
  for variant in ${UNITS:-1 4 ddp}; do  # a number of layers per FSDP2 unit (0: auto), or ddp
    python3 - "$RUNS/scaling.yaml" "$RUNS/w_$variant.yaml" "$variant" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1]))
if sys.argv[3] == "ddp":
    config["training"]["distributed"] = "ddp"
else:
    config["training"]["fsdp2_layers_per_unit"] = int(sys.argv[3])
yaml.safe_dump(config, open(sys.argv[2], "w"))
PY
    CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 1 -m hasten train --config "$RUNS/w_$variant.yaml" \
      --max_steps "$SCALE_STEPS" --output_dir "$RUNS/w_$variant" --no_progress > "$OUT/wrapper_$variant.log" 2>&1
    echo "$variant (one process) exit $?"
    [[ $variant == ddp ]] && compared+=(ddp_one_process="$RUNS/w_ddp/logs") \
      || compared+=(fsdp2_${variant}_per_unit="$RUNS/w_$variant/logs")
  done
  python3 scripts/compare_runs.py "${compared[@]}" --skip 1 --json "$OUT/wrapper.json" | tee "$OUT/wrapper.txt"
  if [ "${PROFILE_STEP:-0}" != 0 ]; then
    python3 scripts/trace_gaps.py "$RUNS"/w_*/logs/profile_step*.trace.json | tee -a "$OUT/wrapper.txt"
    tar czf "$OUT/wrapper_profiles.tgz" -C "$RUNS" $(cd "$RUNS" && ls w_*/logs/profile_step*.txt)
  fi
fi

if (( GPUS >= 2 )) && [[ " ${PARTS:-bench scaling resume elastic} " == *" scaling "* ]]; then
  torchrun --nproc_per_node 2 benchmarks/collective_bandwidth.py 2>&1 | grep -vE "^W1|\*\*\*|OMP_NUM" | tee "$OUT/collectives.txt"
  scaling_configs
  CUDA_VISIBLE_DEVICES=0 python3 -m hasten train --config "$RUNS/scaling.yaml" --max_steps "$SCALE_STEPS" \
    --output_dir "$RUNS/one" --no_progress > "$OUT/one_gpu.log" 2>&1; echo "one gpu exit $?"
  torchrun --nproc_per_node 2 -m hasten train --config "$RUNS/scaling.yaml" --max_steps "$SCALE_STEPS" \
    --output_dir "$RUNS/two" --no_progress > "$OUT/two_gpu.log" 2>&1; echo "two gpu exit $?"
  torchrun --nproc_per_node 2 -m hasten train --config "$RUNS/keep_gathered.yaml" --max_steps "$SCALE_STEPS" \
    --output_dir "$RUNS/two_keep" --no_progress > "$OUT/two_gpu_keep.log" 2>&1; echo "two gpu (kept gathered) exit $?"
  torchrun --nproc_per_node 2 -m hasten train --config "$RUNS/unit_per_layer.yaml" --max_steps "$SCALE_STEPS" \
    --output_dir "$RUNS/two_per_layer" --no_progress > "$OUT/two_gpu_per_layer.log" 2>&1
  echo "two gpu (a unit per layer) exit $?"
  python3 scripts/compare_runs.py one_gpu="$RUNS/one/logs" fsdp2_two_gpu="$RUNS/two/logs" \
    fsdp2_kept_gathered="$RUNS/two_keep/logs" fsdp2_unit_per_layer="$RUNS/two_per_layer/logs" --skip 1 \
    --json "$OUT/scaling.json" | tee "$OUT/scaling.txt"
  if [ "${PROFILE_STEP:-0}" != 0 ]; then
    python3 scripts/trace_gaps.py "$RUNS"/{one,two,two_keep,two_per_layer}/logs/profile_step*.trace.json | tee -a "$OUT/scaling.txt"
    tar czf "$OUT/profiles.tgz" -C "$RUNS" $(cd "$RUNS" && ls {one,two,two_keep,two_per_layer}/logs/profile_step*.txt)
  fi
fi

wait_for() {  # wait_for PATH SECONDS: until PATH exists
  for _ in $(seq "$2"); do [ -e "$1" ] && return 0; sleep 1; done; return 1
}

straight_run() {  # the uninterrupted FSDP2 run that resume and elastic compare their losses with
  [ -e "$RUNS/straight/logs/summary.json" ] && return 0
  torchrun --nproc_per_node 2 -m hasten train --config "$CONFIG" --max_steps "$STEPS" \
    --output_dir "$RUNS/straight" --no_progress > "$OUT/straight.log" 2>&1; echo "uninterrupted exit $?"
}

if (( GPUS >= 2 )) && [[ " ${PARTS:-bench scaling resume elastic} " == *" resume "* ]]; then
  straight_run
  # the whole job dies (SIGKILL: nothing saved on the way out), then a new launch with --resume auto
  setsid torchrun --nproc_per_node 2 -m hasten train --config "$CONFIG" --max_steps "$STEPS" \
    --output_dir "$RUNS/killed" --no_progress > "$OUT/killed.log" 2>&1 &
  LAUNCHER=$!
  # killed after the first checkpoint (interval 10 in the shipped config), well before STEPS
  wait_for "$RUNS/killed/checkpoints/checkpoint-000010/manifest.json" 600 && sleep 5
  # torchrun starts its workers in their own sessions: kill the launcher and every worker
  pkill -KILL -f -- "--output_dir $RUNS/killed"; wait "$LAUNCHER" 2>/dev/null; sleep 1
  echo "killed after: $(ls "$RUNS/killed/checkpoints")" | tee -a "$OUT/resume.txt"
  torchrun --nproc_per_node 2 -m hasten train --config "$CONFIG" --max_steps "$STEPS" \
    --output_dir "$RUNS/killed" --resume auto --no_progress > "$OUT/resumed.log" 2>&1; echo "resumed exit $?" | tee -a "$OUT/resume.txt"
  grep -iE "resum" "$OUT/resumed.log" | head -3 | tee -a "$OUT/resume.txt"
  python3 scripts/compare_runs.py uninterrupted="$RUNS/straight/logs" killed_resumed="$RUNS/killed/logs" \
    --json "$OUT/resume.json" | tee -a "$OUT/resume.txt"

fi

if (( GPUS >= 2 )) && [[ " ${PARTS:-bench scaling resume elastic} " == *" elastic "* ]]; then
  straight_run
  # elastic: torchrun restarts the workers after one dies; they resume from the latest checkpoint
  torchrun --nproc_per_node 2 --max-restarts 1 -m hasten train --config "$CONFIG" --max_steps "$STEPS" \
    --output_dir "$RUNS/elastic" --resume auto --no_progress > "$OUT/elastic.log" 2>&1 &
  LAUNCHER=$!
  wait_for "$RUNS/elastic/checkpoints/checkpoint-000010/manifest.json" 600 && sleep 2
  VICTIM=$(pgrep -P "$LAUNCHER" | tail -1)  # torchrun's workers are its children
  echo "elastic: killing worker $VICTIM" | tee -a "$OUT/resume.txt"
  kill -KILL "$VICTIM"
  timeout 600 tail --pid "$LAUNCHER" -f /dev/null; wait "$LAUNCHER"; echo "elastic exit $?" | tee -a "$OUT/resume.txt"
  python3 scripts/compare_runs.py uninterrupted="$RUNS/straight/logs" elastic="$RUNS/elastic/logs" \
    --json "$OUT/elastic.json" | tee -a "$OUT/resume.txt"
fi
