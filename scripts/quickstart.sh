#!/usr/bin/env bash
# The main job: set everything up, then a real FL experiment on real Fashion-MNIST showing what label
# skew does to FedAvg and what a personalized seed method recovers: FedAvg vs Local-only vs FedReMa in
# the FedReMa paper's setting (20 clients, 600 samples each, 5 groups of 3 dominant classes), 20 rounds
# of 2 local epochs (the paper: 500 of 5); 7 min on 2 CPU cores after set-up (measured from a fresh clone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
for m in fedavg local fedrema; do
  echo "== $m" >&2
  .venv/bin/fedhet run configs/quickstart.yaml --set algorithm.name=$m --set name=quickstart-$m --out "$out/$m"
done
echo
echo "Each client's model on its own held-out 20% (FedAvg: the one global model; Local: trained alone;"
echo "FedReMa: its personalized model):"
.venv/bin/fedhet compare "$out/fedavg" "$out/local" "$out/fedrema" --metric personal_acc --plot "$out/compare.png"
cat <<'TXT'

The FedReMa paper (papers/004, Table 1, after 500 rounds of 5 epochs): FedAvg 86.1, Local 86.0, FedReMa 88.2.
Here, after 20 rounds of 2 epochs, one global model serves clients with skewed labels poorly (FedAvg far
below), training alone already does well on one's own distribution (Local), and FedReMa - personalized
heads aggregated over relevant peers - is best. Measured spread between seeds: see README.
TXT
echo "runs and plots: $out (accuracy.png in each run, compare.png)"
