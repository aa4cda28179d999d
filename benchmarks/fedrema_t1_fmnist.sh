#!/usr/bin/env bash
# FedReMa paper (Liang et al.), Table 1, Fashion-MNIST column (npc=600, s=0.2, K=20, full participation),
# as two single-threaded lanes (a and b). The paper runs T=500; ROUNDS says how many were run here.
#   ROUNDS=50 bash benchmarks/fedrema_t1_fmnist.sh [a|b]   (no lane: both in parallel)
# Re-running resumes unfinished runs and skips finished ones; then:
#   .venv/bin/python benchmarks/collect.py --metric personal_acc ... (see benchmarks/results/fedrema_t1_fmnist_*.md)
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-50}
OUT=${OUT:-runs/fedrema_t1_fmnist_r$ROUNDS}
mkdir -p "$OUT"
P=configs/papers/fedrema
run() {  # method seed
  local tag=$1_s$2
  [ -f "$OUT/$tag/summary.json" ] && grep -q '"status": "completed"' "$OUT/$tag/summary.json" && return 0
  if [ -f "$OUT/$tag/config.yaml" ]; then
    .venv/bin/fedhet run --resume "$OUT/$tag" --threads 1 --no-progress >> "$OUT/$tag.log" 2>&1
  else
    .venv/bin/fedhet run "$P/t1_fmnist_$1.yaml" --set seed="$2" --set train.rounds="$ROUNDS" --set run.threads=1 --set run.engine=reference --set run.checkpoint_every=5 \
      --out "$OUT/$tag" --no-progress > "$OUT/$tag.log" 2>&1
  fi
}
lane_a() { run fedrema 0; run fedavg 0; run local 0; run fedper 0; run fedproto 0; run fedbabu 0; }
lane_b() { run fedrema 1; run fedavg 1; run fedpac 0; run perfedavg 0; run feddistill 0; run fedprox 0; }
case "${1:-both}" in
  a) lane_a ;;
  b) lane_b ;;
  *) lane_a & lane_b & wait ;;
esac
