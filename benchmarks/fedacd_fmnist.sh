#!/usr/bin/env bash
# FedACD reduced reproduction on Fashion-MNIST: K=20, 8 clients per round (40%),
# Dirichlet(beta) label skew, simple_cnn (FedNH's Conv2Cifar on 1x28x28), E=5, batch 64, SGD lr 0.01
# momentum 0.9 wd 1e-5, the same for every method (configs/papers/fedacd/fmnist_b<beta>_<method>.yaml,
# which carry the paper's protocol, T=200 on the whole training set). Compute forces these overrides,
# the same for every method: POOL (fraction of every class kept), ROUNDS, fp32, final = mean of the
# last 2 evaluations (every 5 rounds).
#   bash benchmarks/fedacd_fmnist.sh          # re-running resumes unfinished runs, skips finished ones
# Two queues run side by side, one torch thread each (2 cores).
# then: .venv/bin/python benchmarks/fedacd_table.py "$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
POOL=${POOL:-0.1}; ROUNDS=${ROUNDS:-20}
OUT=${OUT:-runs/fedacd_fmnist_p${POOL}_r${ROUNDS}}
mkdir -p "$OUT"
P=configs/papers/fedacd
run() {  # beta method seed
  local tag=b$1_$2_s$3
  if [ -f "$OUT/$tag/summary.json" ] && grep -q '"status": "\(completed\|failed\)"' "$OUT/$tag/summary.json"; then
    return 0
  fi
  echo "$(date +%T) $tag" >&2
  if [ -f "$OUT/$tag/config.yaml" ]; then
    .venv/bin/fedhet run --resume "$OUT/$tag" --no-progress --threads 1 >> "$OUT/$tag.log" 2>&1
  else
    .venv/bin/fedhet run "$P/fmnist_b$1_$2.yaml" --set seed="$3" --set data.pool_fraction="$POOL" \
      --set train.rounds="$ROUNDS" --set run.precision=fp32 --set eval.final_window=2 \
      --out "$OUT/$tag" --no-progress --threads 1 > "$OUT/$tag.log" 2>&1
  fi
}
queue_a() { for m in fedacd fedavg fedlc fedntd; do run 0.1 $m 0; done; run 0.05 fedacd 0; run 0.05 fedacd_base 0; }
queue_b() { for m in fedacd_base fedprox fedrod fednh; do run 0.1 $m 0; done; run 0.05 fedavg 0; }
queue_a & queue_b & wait
