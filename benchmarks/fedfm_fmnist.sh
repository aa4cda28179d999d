#!/usr/bin/env bash
# FedFM reduced reproduction on Fashion-MNIST (issue 12): K=10, full participation, NIID-1
# (Dirichlet 0.5) and NIID-2, cnn2; FedAvg vs SCAFFOLD vs FedFM-l2 vs FedFM (CG) vs FedFM-Lite (a=2).
# The configs (configs/papers/fedfm/fmnist_*) carry the paper's protocol (T=100, E=10, the whole
# training set); compute forces the overrides below, the same for every method:
#   POOL (fraction of every class kept), ROUNDS, EPOCHS, START (T_s, FedFM's warm-up), fp32.
#   bash benchmarks/fedfm_fmnist.sh          # re-running resumes unfinished runs, skips finished ones
# then: .venv/bin/python benchmarks/fedfm_table.py "$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
POOL=${POOL:-0.2}; ROUNDS=${ROUNDS:-24}; EPOCHS=${EPOCHS:-2}; START=${START:-8}
OUT=${OUT:-runs/fedfm_fmnist_p${POOL}_r${ROUNDS}_e${EPOCHS}}
mkdir -p "$OUT"
P=configs/papers/fedfm
run() {  # partition method seed
  local tag=$1_$2_s$3
  [ -f "$OUT/$tag/summary.json" ] && grep -q '"status": "completed"' "$OUT/$tag/summary.json" && return 0
  echo "$(date +%T) $tag" >&2
  if [ -f "$OUT/$tag/config.yaml" ]; then
    .venv/bin/fedhet run --resume "$OUT/$tag" --no-progress >> "$OUT/$tag.log" 2>&1
  else
    local extra=()
    case $2 in fedfm*) extra=(--set algorithm.params.start_round="$START") ;; esac
    .venv/bin/fedhet run "$P/fmnist_$1_$2.yaml" --set seed="$3" --set data.pool_fraction="$POOL" \
      --set train.rounds="$ROUNDS" --set train.local_epochs="$EPOCHS" --set run.precision=fp32 \
      --set run.checkpoint_every=5 "${extra[@]}" --out "$OUT/$tag" --no-progress > "$OUT/$tag.log" 2>&1
  fi
}
for seed in 0; do
  for m in fedavg fedfm scaffold fedfm_l2 fedfm_lite_a2; do run niid1 $m $seed; run niid2 $m $seed; done
done
for m in fedavg fedfm; do run niid1 $m 1; run niid2 $m 1; done
