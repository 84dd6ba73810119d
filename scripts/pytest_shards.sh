#!/usr/bin/env bash
# Runs one pytest selection as N processes side by side (round-robin over its collected node ids):
# the GPU parity tests' tiny models leave an H200 mostly idle, so N=3 ran the 135 LoRA parity
# tests in 272 s against about 420 s in one process (5b235b3). Each shard's output follows the
# others' on stdout once all have ended; exits with the first nonzero shard status.
#   bash scripts/pytest_shards.sh 3 tests/gpu/test_model_parity_cuda.py -k peft_lora -q -rs
set -uo pipefail
shards=$1; shift
work=$(mktemp -d)
# the selection (paths and -k, collected once) apart from the options each shard passes on
selection=(); options=(); take_k=0
for arg in "$@"; do
  if (( take_k )); then selection+=("$arg"); take_k=0; continue; fi
  case $arg in -k) selection+=("$arg"); take_k=1 ;; -*) options+=("$arg") ;; *) selection+=("$arg") ;; esac
done
python3 -m pytest --collect-only -q "${selection[@]}" 2>/dev/null | grep "::" > "$work/ids"
echo "pytest_shards: $(wc -l < "$work/ids") tests in $shards processes"
if [[ ! -s $work/ids ]]; then echo "pytest_shards: the selection collected no tests: $*"; rm -rf "$work"; exit 5; fi
# cut off (the caller's timeout): the shards stopped, what each printed so far shown
trap 'kill $(jobs -p) 2>/dev/null; for f in "$work"/out.*; do echo "=== $f (cut off)"; cat "$f"; done; rm -rf "$work"; exit 124' TERM INT
for ((i = 0; i < shards; i++)); do
  awk -v n="$shards" -v i="$i" 'NR % n == i' "$work/ids" > "$work/ids.$i"
  [[ -s $work/ids.$i ]] || continue
  mapfile -t ids < "$work/ids.$i"
  (python3 -m pytest -p no:cacheprovider "${options[@]}" "${ids[@]}" > "$work/out.$i" 2>&1; echo $? > "$work/rc.$i") &
done
wait
status=0
for ((i = 0; i < shards; i++)); do
  [[ -f $work/out.$i ]] || continue
  echo "=== shard $i of $shards"; cat "$work/out.$i"
  rc=$(cat "$work/rc.$i"); (( status == 0 && rc != 0 && rc != 5 )) && status=$rc
done
rm -rf "$work"
exit $status
