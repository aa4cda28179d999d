#!/usr/bin/env bash
# engine_speed.py side by side with an earlier commit, in one sitting.
#
#   bash benchmarks/engine_speed_vs.sh [BASE_REV]        # default: 0d00b70 (the parent of the foundation work)
#   PRECISIONS="fp32 bf16" ROUNDS=3 bash benchmarks/engine_speed_vs.sh   # precisions / measured rounds per mode
#
# BASE_REV is checked out into a temporary worktree; benchmarks/engine_speed_side.py runs that commit's own
# engine_speed.py functions on its sources (PYTHONPATH) in the same venv. Settings alternate base/head, head/base, ... so that drift
# in the machine's load hits both sides alike. Each run's JSON is kept under
# benchmarks/results/engine_speed_vs/, and benchmarks/engine_speed_vs.py writes the ratio table.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-0d00b70}
PY=${PY:-.venv/bin/python}
# fp32 only unless the CPU computes bf16 natively (emulated bf16 runs at a tenth of the speed).
PRECISIONS=${PRECISIONS:-$("$PY" -c "from fedhet.training.precision import bf16_native; print('fp32 bf16' if bf16_native('cpu') else 'fp32')")}
ROUNDS=${ROUNDS:-2}
HEAD_REV=$(git rev-parse --short HEAD)
BASE_REV=$(git rev-parse --short "$BASE")
OUT=benchmarks/results/engine_speed_vs
TREE=$(mktemp -d /tmp/fedhet-base-XXXX)
trap 'git worktree remove --force "$TREE" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$TREE" "$BASE_REV" >/dev/null
mkdir -p "$OUT"

run_side() {  # side setting index: each side measured by its own engine_speed.py through one driver
  local side=$1 setting=$2 i=$3 tree rev
  if [ "$side" = base ]; then tree=$TREE rev=$BASE_REV; else tree=$PWD rev=$HEAD_REV; fi
  PYTHONPATH="$tree/src" "$PY" benchmarks/engine_speed_side.py "$tree/benchmarks/engine_speed.py" \
    "$setting" "$OUT/${side}_${rev}_${setting}_$i.json" --precisions $PRECISIONS --rounds "$ROUNDS"
}

order=(base head)
for setting in fedcme_a0.5 cross_device fedcme_a0.1; do
  for side in "${order[@]}"; do
    echo "== $setting: $side"
    run_side "$side" "$setting" 1
  done
  order=("${order[1]}" "${order[0]}")
done
"$PY" benchmarks/engine_speed_vs.py "$OUT" --base "$BASE_REV" --head "$HEAD_REV"
