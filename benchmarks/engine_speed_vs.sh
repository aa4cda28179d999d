#!/usr/bin/env bash
# engine_speed.py side by side with an earlier commit, in one sitting.
#
#   bash benchmarks/engine_speed_vs.sh [BASE_REV]        # default: 0d00b70 (the parent of the foundation work)
#
# BASE_REV is checked out into a temporary worktree and run with its own engine_speed.py on the same
# venv (PYTHONPATH puts its sources first). Settings alternate base/head, head/base, ... so that drift
# in the machine's load hits both sides alike. Each run's JSON is kept under
# benchmarks/results/engine_speed_vs/, and benchmarks/engine_speed_vs.py writes the ratio table.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-0d00b70}
PY=${PY:-.venv/bin/python}
HEAD_REV=$(git rev-parse --short HEAD)
BASE_REV=$(git rev-parse --short "$BASE")
OUT=benchmarks/results/engine_speed_vs
TREE=$(mktemp -d /tmp/fedhet-base-XXXX)
trap 'git worktree remove --force "$TREE" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$TREE" "$BASE_REV" >/dev/null
mkdir -p "$OUT"

run_side() {  # side setting index
  local side=$1 setting=$2 i=$3
  if [ "$side" = base ]; then
    (cd "$TREE" && PYTHONPATH="$TREE/src" "$OLDPWD/$PY" benchmarks/engine_speed.py --settings "$setting" --no-memory)
    cp "$TREE/benchmarks/results/engine_speed.json" "$OUT/base_${BASE_REV}_${setting}_$i.json"
  else
    PYTHONPATH="$PWD/src" "$PY" benchmarks/engine_speed.py --settings "$setting" --no-memory
    cp benchmarks/results/engine_speed.json "$OUT/head_${HEAD_REV}_${setting}_$i.json"
    git checkout -- benchmarks/results/engine_speed.json benchmarks/results/engine_speed.md 2>/dev/null || true
  fi
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
