#!/usr/bin/env bash
# bf16 precision check: FedAvg in the FedCME Fashion-MNIST setting (alpha=0.5, K50 M10, E=6, B=32,
# lr 0.01), seeds 0 and 1, fp32 vs bf16 autocast, the same ROUNDS each, one single-threaded lane.
#   ROUNDS=15 bash benchmarks/bf16_accuracy.sh      (re-running resumes / skips finished runs)
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-15}
OUT=${OUT:-runs/bf16_accuracy_r$ROUNDS}
mkdir -p "$OUT"
run() {  # precision seed
  local tag=fedavg_$1_s$2
  [ -f "$OUT/$tag/summary.json" ] && grep -q '"status": "completed"' "$OUT/$tag/summary.json" && return 0
  if [ -f "$OUT/$tag/config.yaml" ]; then
    .venv/bin/fedhet run --resume "$OUT/$tag" --threads 1 --no-progress >> "$OUT/$tag.log" 2>&1
  else
    .venv/bin/fedhet run configs/papers/fedcme/fmnist_a0.5_k50_m10_fedavg.yaml --set seed="$2" --set name=fedavg-fmnist-a0.5-k50-m10-"$1" \
      --set train.rounds="$ROUNDS" --set run.precision="$1" --set run.threads=1 --set run.engine=reference \
      --set run.checkpoint_every=5 --out "$OUT/$tag" --no-progress > "$OUT/$tag.log" 2>&1
  fi
}
run bf16 0; run fp32 0; run bf16 1; run fp32 1
