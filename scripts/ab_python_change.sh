#!/usr/bin/env bash
# A/B of a Python-only change on the GPU machine, in one call: the tree as it is against the same
# tree with FILES taken from BASE_DIR (the files as before the change, at the same relative paths:
# the device's copy of .git can be stale, so they travel as files), the built extension shared,
# alternating ROUNDS times so drift between runs lands on both sides. COMMAND runs each time with
# $AB_OUT set to a fresh folder.
#   mkdir -p ab_base && git archive <commit> src/a.py src/b.py | tar x -C ab_base
#   BASE_DIR=ab_base FILES="src/a.py src/b.py" ROUNDS=2 COMMAND='python3 benchmarks/default_job.py --out $AB_OUT' \
#     OUT=/tmp/out bash scripts/ab_python_change.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${BASE_DIR:?}" "${FILES:?}" "${COMMAND:?}" "${OUT:?}"
mkdir -p "$OUT/ab"
for f in $FILES; do cp "$f" "$OUT/ab/$(echo "$f" | tr / _).new"; cp "$BASE_DIR/$f" "$OUT/ab/$(echo "$f" | tr / _).base" || exit 2; done
swap() { for f in $FILES; do cp "$OUT/ab/$(echo "$f" | tr / _).$1" "$f"; done; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in new base; do
    swap "$side"
    export AB_OUT="$OUT/$side-$round"; mkdir -p "$AB_OUT"
    echo "== $side round $round"; bash -c "$COMMAND" > "$AB_OUT/log.txt" 2>&1; echo "rc $?"
    grep -E "tok/s  step" "$AB_OUT/log.txt" | grep -v "^step"
  done
done
swap new
