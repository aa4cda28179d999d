#!/usr/bin/env bash
# engine_speed.py side by side with earlier commits, in one sitting.
#
#   bash benchmarks/engine_speed_vs.sh [BASE_REV ...]    # default: 0d00b70 (the parent of the foundation work)
#   REPEATS=2 PRECISIONS="fp32 bf16" ROUNDS=3 bash benchmarks/engine_speed_vs.sh 0d00b70 930aeef
#
# Each BASE_REV is checked out into a temporary worktree; benchmarks/engine_speed_side.py runs that
# commit's own engine_speed.py functions on its sources (PYTHONPATH) in the same venv. Per setting and
# repeat every side runs once, and the order of the sides rotates from one to the next, so that drift in
# the machine's load hits all sides alike. The sitting's JSON files and ratio table go to
# benchmarks/results/engine_speed_vs/<date>_head-<rev>/ (benchmarks/engine_speed_vs.py writes the table).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- 0d00b70
PY=${PY:-.venv/bin/python}
# fp32 only unless the CPU computes bf16 natively (emulated bf16 runs at a tenth of the speed).
PRECISIONS=${PRECISIONS:-$("$PY" -c "from fedhet.training.precision import bf16_native; print('fp32 bf16' if bf16_native('cpu') else 'fp32')")}
ROUNDS=${ROUNDS:-2}
REPEATS=${REPEATS:-1}
HEAD_REV=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain --untracked-files=no -- src benchmarks/engine_speed.py)" ]; then
  echo "engine_speed_vs: uncommitted changes under src/ or in engine_speed.py; commit them first so that 'head' is $HEAD_REV" >&2
  exit 2
fi
OUT=benchmarks/results/engine_speed_vs/$(date -u +%Y-%m-%d)_head-$HEAD_REV
mkdir -p "$OUT"
declare -A TREES
BASE_REVS=()
cleanup() { for t in "${TREES[@]}"; do git worktree remove --force "$t" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
for base in "$@"; do
  rev=$(git rev-parse --short "$base")
  BASE_REVS+=("$rev")
  TREES[$rev]=$(mktemp -d /tmp/fedhet-base-XXXX)
  git worktree add --detach "${TREES[$rev]}" "$rev" >/dev/null
done

run_side() {  # side setting index: each side measured by its own engine_speed.py through one driver
  local side=$1 setting=$2 i=$3 tree name
  if [ "$side" = head ]; then tree=$PWD name=head_$HEAD_REV; else tree=${TREES[$side]} name=base_$side; fi
  echo "== $setting, repeat $i: $name"
  PYTHONPATH="$tree/src" "$PY" benchmarks/engine_speed_side.py "$tree/benchmarks/engine_speed.py" \
    "$setting" "$OUT/${name}_${setting}_$i.json" --precisions $PRECISIONS --rounds "$ROUNDS"
}

order=("${BASE_REVS[@]}" head)
for i in $(seq 1 "$REPEATS"); do
  for setting in fedcme_a0.5 cross_device fedcme_a0.1; do
    for side in "${order[@]}"; do run_side "$side" "$setting" "$i"; done
    order=("${order[@]:1}" "${order[0]}")
  done
done
echo done
"$PY" benchmarks/engine_speed_vs.py "$OUT" --head "$HEAD_REV" --base "${BASE_REVS[@]}" --command "bash benchmarks/engine_speed_vs.sh $* (REPEATS=$REPEATS ROUNDS=$ROUNDS PRECISIONS='$PRECISIONS')"
