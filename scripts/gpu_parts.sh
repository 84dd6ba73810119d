# Shared by the scripts/gpu_issue*.sh device runs (sourced, not run): a budgeted `part` runner
# that logs each part to $LOGS/NAME.log with its rc and seconds in $SUMMARY, and the carried
# wheels (.whl/*.whl) unpacked to /tmp/site. The caller sets OUT, LOGS, BUDGET and PARTS and
# echoes its own first summary line.
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
timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1 | tee -a "$SUMMARY"

