#!/usr/bin/env bash
# Baselines and the FedCME reproduction in the FedCME paper's Fashion-MNIST
# setting alpha=0.5, K=50, M=10, B=32, E=6, lr 0.01, as two single-threaded lanes (a and b).
#   ROUNDS=25 bash benchmarks/fmnist_a0.5_k50_m10.sh [a|b]   (no lane: both in parallel)
# The paper does not state T; the results file says which ROUNDS was used. Re-running resumes.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-25}
OUT=${OUT:-runs/fmnist_a0.5_k50_m10_r$ROUNDS}
mkdir -p "$OUT"
P=configs/papers/fedcme
B=configs/baselines
run() {  # config seed tag
  [ -f "$OUT/$3/summary.json" ] && grep -q '"status": "completed"' "$OUT/$3/summary.json" && return 0
  if [ -f "$OUT/$3/config.yaml" ]; then
    .venv/bin/fedhet run --resume "$OUT/$3" --threads 1 --no-progress >> "$OUT/$3.log" 2>&1
  else
    .venv/bin/fedhet run "$1" --set seed="$2" --set train.rounds="$ROUNDS" --set run.threads=1 \
      --out "$OUT/$3" --no-progress > "$OUT/$3.log" 2>&1
  fi
}
lane_a() {
  run $P/fmnist_a0.5_k50_m10_fedavg.yaml 0 fedavg_s0
  run $P/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml 0 fedcme_mu0.01_s0
  run $P/fmnist_a0.5_k50_m10_fedprox_mu0.01.yaml 0 fedprox_mu0.01_s0
  run $P/fmnist_a0.5_k50_m10_fedrs_a0.5.yaml 0 fedrs_a0.5_s0
  run $B/fmnist_a0.5_k50_m10_scaffold.yaml 0 scaffold_s0
  run $B/fmnist_a0.5_k50_m10_fednova.yaml 0 fednova_s0
}
lane_b() {
  run $P/fmnist_a0.5_k50_m10_fedavg.yaml 1 fedavg_s1
  run $P/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml 1 fedcme_mu0.01_s1
  run $P/fmnist_a0.5_k50_m10_fedcme_oe.yaml 0 fedcme_oe_s0
  run $P/fmnist_a0.5_k50_m10_moon.yaml 0 moon_s0
  run $B/fmnist_a0.5_k50_m10_feddyn.yaml 0 feddyn_s0
}
case "${1:-both}" in
  a) lane_a ;;
  b) lane_b ;;
  *) lane_a & lane_b & wait ;;
esac
