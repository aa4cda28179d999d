#!/usr/bin/env bash
# engine_speed.py side by side with earlier commits, in one sitting.
#
#   bash benchmarks/engine_speed_vs.sh [BASE_REV ...]    # default: 0d00b70 (the parent of the foundation work)
#   REPEATS=2 PRECISIONS="fp32 bf16" ROUNDS=3 bash benchmarks/engine_speed_vs.sh 0d00b70 930aeef
#
# Each BASE_REV is checked out into a temporary worktree; benchmarks/engine_speed_side.py runs that
# commit's own engine_speed.py functions on its sources (PYTHONPATH) in the same venv. Per setting and
# repeat every side runs once, and the order of the sides rotates from one setting and repeat to the
# next, so that drift in the machine's load hits all sides alike. The sitting's JSON files and ratio
# table go to benchmarks/results/engine_speed_vs/<date>_<time>_head-<rev>/ (engine_speed_vs.py).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- 0d00b70
PY=${PY:-.venv/bin/python}
# fp32 only unless the CPU computes bf16 natively (emulated bf16 runs at a tenth of the speed).
PRECISIONS=${PRECISIONS:-$("$PY" -c "from fedhet.training.precision import bf16_native; print('fp32 bf16' if bf16_native('cpu') else 'fp32')")}
ROUNDS=${ROUNDS:-2}
REPEATS=${REPEATS:-1}
HEAD_REV=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain -- src benchmarks/engine_speed.py benchmarks/engine_speed_side.py benchmarks/step_profile.py)" ]; then
  echo "engine_speed_vs: uncommitted or untracked files under src/ or in the benchmark scripts; commit them first so that 'head' is $HEAD_REV" >&2
  exit 2
fi
# One folder per sitting (date, time and head), so that two sittings never share a median.
OUT=benchmarks/results/engine_speed_vs/$(date -u +%Y-%m-%d_%H%M)_head-$HEAD_REV
if [ -e "$OUT" ]; then echo "engine_speed_vs: $OUT exists already; wait a minute and start again" >&2; exit 2; fi
declare -A TREES
BASE_REVS=()
cleanup() { for t in "${TREES[@]}"; do git worktree remove --force "$t" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
for base in "$@"; do
  rev=$(git rev-parse --short "$base")
  if [ "$rev" = "$HEAD_REV" ] || [ -n "${TREES[$rev]:-}" ]; then
    echo "engine_speed_vs: base $base is $rev, which is the head or another base already given" >&2; exit 2
  fi
  BASE_REVS+=("$rev")
  TREES[$rev]=$(mktemp -d /tmp/fedhet-base-XXXX)
  git worktree add --detach "${TREES[$rev]}" "$rev" >/dev/null
done
mkdir -p "$OUT"

run_side() {  # side setting index: each side measured by its own engine_speed.py through one driver
  local side=$1 setting=$2 i=$3 tree name
  if [ "$side" = head ]; then tree=$PWD name=head_$HEAD_REV; else tree=${TREES[$side]} name=base_$side; fi
  echo "== $setting, repeat $i: $name"
  PYTHONPATH="$tree/src" "$PY" benchmarks/engine_speed_side.py "$tree/benchmarks/engine_speed.py" \
    "$setting" "$OUT/${name}_${setting}_$i.json" --precisions $PRECISIONS --rounds "$ROUNDS"
}

# The sides start at offset (repeat + setting) mod n, so over n repeats every side takes every
# position in every setting (with one base: base/head, head/base, ...).
sides=("${BASE_REVS[@]}" head)
n=${#sides[@]}
settings=(fedcme_a0.5 cross_device fedcme_a0.1)
for i in $(seq 1 "$REPEATS"); do
  for s in "${!settings[@]}"; do
    for k in $(seq 0 $((n - 1))); do
      run_side "${sides[$(((i - 1 + s + k) % n))]}" "${settings[$s]}" "$i"
    done
  done
done
echo done
"$PY" benchmarks/engine_speed_vs.py "$OUT" --head "$HEAD_REV" --base "${BASE_REVS[@]}" \
  --command "REPEATS=$REPEATS ROUNDS=$ROUNDS PRECISIONS='$PRECISIONS' bash benchmarks/engine_speed_vs.sh $*"
