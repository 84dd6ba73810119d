# Shared by the scripts/gpu_issue*.sh device runs (sourced, not run): a budgeted `part` runner
# that logs each part to $LOGS/NAME.log with its rc and seconds in $SUMMARY, and the carried
# wheels (.whl/*.whl) unpacked to /tmp/site, and the `build` part (pip install -e ., `built` set to 0
# when it fails). The caller sets BUDGET, PARTS and RUN_NAME (and may set OUT) before sourcing this
# from the repository root.
OUT=${OUT:-gpu-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# The rows name the commit. The device machine's copy of the tree may carry a stale .git (at
# 76c41f5 a run labelled itself 1735314 from it), so pass HASTEN_COMMIT from this machine; without
# it the label is the copy's HEAD, marked -dirty where the tracked files differ from that commit.
if [[ -z ${HASTEN_COMMIT:-} ]]; then  # the benchmarks' own label (benchmarks/common.py commit())
  HASTEN_COMMIT=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import common; print(common.commit())' \
    2>/dev/null || echo unknown)
  [[ $HASTEN_COMMIT == *-dirty ]] && echo "WARNING: the tracked files differ from ${HASTEN_COMMIT%-dirty}; pass HASTEN_COMMIT=<commit> to label the rows" >&2
fi
export HASTEN_COMMIT
START=$SECONDS
SUMMARY="$LOGS/summary.txt"
echo "$RUN_NAME at $HASTEN_COMMIT, budget ${BUDGET} s, parts:$PARTS" | tee "$SUMMARY"

# part NAME CAP CMD...: CMD under timeout (CAP, or less when less time is left), output in $LOGS/NAME.log
part() {
  local name=$1 cap=$2; shift 2
  local limit=$(( BUDGET - (SECONDS - START) - 15 ))  # 15 s: timeout's grace (5 s) and the tar
  (( limit > cap )) && limit=$cap
  if (( limit < 20 )); then
    echo "$name: SKIPPED, ${limit} s left" | tee -a "$SUMMARY"
    return 124
  fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local note=""
  (( rc == 124 || rc == 137 )) && note=" (TIMED OUT)"
  echo "$name: rc $rc in $(( SECONDS - t0 )) s, limit $limit s$note" | tee -a "$SUMMARY"
  return $rc
}

if compgen -G ".whl/*.whl" > /dev/null; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/wheels.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# site-package bundles too large as wheels (flash-linear-attention with TileLang and its needs,
# stripped of what they do not use here): .whl/*.tar.xz unpacked to /tmp/site as well
if compgen -G ".whl/*.tar.xz" > /dev/null; then
  mkdir -p /tmp/site
  for bundle in .whl/*.tar.xz; do timeout 120 tar xJf "$bundle" -C /tmp/site; done
  [[ ":${PYTHONPATH:-}:" == *":/tmp/site:"* ]] || export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1 | tee -a "$SUMMARY"

# The GPU's clocks, power and temperature: one snapshot in the summary, and a sample every 2 s
# for the whole call in gpu_clocks.log (why one machine's W4 runs 3-4% slower than another's:
# rows of the same code have differed that much between machines, not within a call)
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,pci.bus_id,power.limit,clocks.max.sm,clocks.sm,clocks.mem,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv 2>&1 | tee -a "$SUMMARY"
  nvidia-smi dmon -s pc -d 2 -o T > "$LOGS/gpu_clocks.log" 2>&1 &
  CLOCK_SAMPLER=$!
  trap 'kill $CLOCK_SAMPLER 2> /dev/null' EXIT
fi
# stop_clock_sampler: before the logs are packed, and what the clocks did while the GPU was busy
stop_clock_sampler() {
  [[ -n "${CLOCK_SAMPLER:-}" ]] && kill "$CLOCK_SAMPLER" 2> /dev/null
  [[ -s "$LOGS/gpu_clocks.log" ]] && python3 - "$LOGS/gpu_clocks.log" << 'PY' 2>&1 | tee -a "$SUMMARY"
import sys  # dmon's columns by its header; the means over samples drawing more than 200 W (busy)
lines = open(sys.argv[1]).read().splitlines()
names = next((l.lstrip("#").split() for l in lines if l.startswith("#") and "pwr" in l), None)
rows = [l.split() for l in lines if l and not l.startswith("#")]
rows = [dict(zip(names, r)) for r in rows if names and len(r) == len(names)]
busy = [r for r in rows if r.get("pwr", "-").isdigit() and int(r["pwr"]) > 200]
means = {k: sum(int(r[k]) for r in busy) / len(busy) for k in names or [] if busy and all(r[k].isdigit() for r in busy)}
print(f"gpu while busy ({len(busy)} samples of {len(rows)}): " + ", ".join(f"{k} {v:.0f}" for k, v in means.items() if k != "gpu"))
PY
}

# CUTLASS's headers (the experts' grouped GEMM kernels): .whl/cutlass-include.txz, where carried
if [[ -f .whl/cutlass-include.txz ]]; then
  mkdir -p /tmp/cutlass && tar xJf .whl/cutlass-include.txz -C /tmp/cutlass && export HASTEN_CUTLASS_DIR=/tmp/cutlass
fi

built=1
if [[ $PARTS == *" build "* ]]; then
  part build 300 python3 -m pip install -v --no-build-isolation --no-deps -e . || built=0
  grep "hasten: " "$LOGS/build.log" 2>/dev/null | sort -u | tee -a "$SUMMARY"
  (( built )) || tail -30 "$LOGS/build.log"
fi
