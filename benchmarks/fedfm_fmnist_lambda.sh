#!/usr/bin/env bash
# FedFM's lambda on the Fashion-MNIST proxy: the paper's lambda=50 was chosen for ResNet-18 on
# CIFAR ("we tune the hyper-parameters in a reasonable range"); this adds FedFM runs with other
# lambdas, same overrides as benchmarks/fedfm_fmnist.sh (and into the same folder).
#   LAMS="5" bash benchmarks/fedfm_fmnist_lambda.sh   # after (or without) fedfm_fmnist.sh
set -uo pipefail
cd "$(dirname "$0")/.."
POOL=${POOL:-0.2}; ROUNDS=${ROUNDS:-24}; EPOCHS=${EPOCHS:-2}; START=${START:-8}; LAMS=${LAMS:-5}
OUT=${OUT:-runs/fedfm_fmnist_p${POOL}_r${ROUNDS}_e${EPOCHS}}
mkdir -p "$OUT"
for lam in $LAMS; do
  for part in niid1 niid2; do
    tag=${part}_fedfm_lam${lam}_s0
    [ -f "$OUT/$tag/summary.json" ] && grep -q '"status": "completed"' "$OUT/$tag/summary.json" && continue
    echo "$(date +%T) $tag" >&2
    if [ -f "$OUT/$tag/config.yaml" ]; then
      .venv/bin/fedhet run --resume "$OUT/$tag" --no-progress >> "$OUT/$tag.log" 2>&1
    else
      .venv/bin/fedhet run "configs/papers/fedfm/fmnist_${part}_fedfm.yaml" --set seed=0 --set data.pool_fraction="$POOL" \
        --set train.rounds="$ROUNDS" --set train.local_epochs="$EPOCHS" --set run.precision=fp32 \
        --set run.checkpoint_every=5 --set algorithm.params.start_round="$START" --set algorithm.params.lam="$lam" \
        --out "$OUT/$tag" --no-progress > "$OUT/$tag.log" 2>&1
    fi
  done
done
