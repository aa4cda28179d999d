"""Semantic mutation: each listed input of a seed method swapped for its plausible wrong neighbour
(the received model for the locally trained one, a constant for the configured value, ...), one
patch at a time, against the method's tests. A swap the tests do not fail on is a gap.

    .venv/bin/python scripts/wiring_mutants.py                  # every listed swap
    .venv/bin/python scripts/wiring_mutants.py --method fedacd  # one method's
    .venv/bin/python scripts/wiring_mutants.py --list           # the list: input, equation, test

Each swap is a text replacement in one source file, applied to this checkout's tree, run, and
undone (also when interrupted); runs started meanwhile from the same tree would import the swapped
file, so run it in a checkout of its own (``git worktree add``) while anything else uses this one.
``--python`` names the interpreter (default: this checkout's .venv). It writes
benchmarks/results/wiring_mutants.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Swap:
    method: str
    input: str          # what the step reads, in the paper's terms
    where: str          # equation or section of the paper
    wrong: str          # the plausible wrong neighbour the patch puts in its place
    file: str
    old: str
    new: str
    tests: str          # the test file(s) run against it


FCA = "src/fedhet/algorithms/fedclassavg.py"
ACD = "src/fedhet/algorithms/fedacd.py"
FCA_TESTS = "tests/algorithms/test_fedclassavg.py"
ACD_TESTS = "tests/algorithms/test_fedacd.py"

SWAPS = [
    # FedClassAvg (Jang et al., ICPP 2022)
    Swap("fedclassavg", "the proximal anchor: the received global classifier", "Eq. 4, L_R",
         "the client's own classifier from its last round", FCA,
         'result = client.train(weights, self.terms(msg.arrays["head"]), augment=augment)',
         'result = client.train(weights, self.terms(select(state["model"], HEAD) if state and "model" in state '
         'else msg.arrays["head"]), augment=augment)', FCA_TESTS),
    Swap("fedclassavg", "rho, the proximal weight", "Eq. 4, Table 1", "the default 0.4662 whatever is configured",
         FCA, "out.append(HeadProximal(anchor, p.rho))", "out.append(HeadProximal(anchor, 0.4662))", FCA_TESTS),
    Swap("fedclassavg", "the SupCon temperature", "Eq. 4, L_CL (the code's 100)", "the default whatever is configured",
         FCA, "SupervisedContrastive(p.temperature, p.base_temperature)",
         "SupervisedContrastive(100.0, p.base_temperature)", FCA_TESTS),
    Swap("fedclassavg", "the SupCon base temperature", "Eq. 4, L_CL (the code's 0.07)",
         "the default whatever is configured", FCA, "SupervisedContrastive(p.temperature, p.base_temperature)",
         "SupervisedContrastive(p.temperature, 0.07)", FCA_TESTS),
    Swap("fedclassavg", "the classifier a client starts its round from: the global one", "Sec. 4.1",
         "its own previous classifier (the global one never loaded)", FCA,
         'weights = {**weights, **msg.arrays["head"], **(msg.arrays.get("body") or {})}',
         'weights = {**weights, **(msg.arrays.get("body") or {})}', FCA_TESTS),
    Swap("fedclassavg", "what is averaged: the classifiers only", "Sec. 4.1",
         "the whole uploaded model (bodies too)", FCA,
         'uploads = {"head": select(result.weights, HEAD)}', 'uploads = {"head": dict(result.weights)}', FCA_TESTS),
    Swap("fedclassavg", "the averaging weights: the clients' sample sizes", "Sec. 4.1", "uniform weights", FCA,
         'sizes = [float(replies[c].scalars["num_samples"]) for c in cids]', "sizes = [1.0 for c in cids]", FCA_TESTS),
    Swap("fedclassavg", "the evaluated model: the client's own last trained model", "Sec. 5 (the code)",
         "the new global classifier on the client's body", FCA,
         'return client_state["model"] if client_state and "model" in client_state else None',
         'return {**client_state["model"], **state["head"]} if client_state and "model" in client_state else None',
         FCA_TESTS),
    Swap("fedclassavg", "the pre-training epoch's batch order: its own stream after the round's epochs", "[C]",
         "the round's first epoch's stream again", FCA, "start_epoch=client.settings.epochs)", "start_epoch=0)",
         FCA_TESTS),
    # FedACD (Zhou et al.)
    Swap("fedacd", "epoch 0's P: the received model on the client's data", "Sec. 4.1",
         "the identity matrix (no estimate)", ACD,
         "P, _ = local_probability_matrix(client.model, weights, client.data, num_classes)\n        options",
         "P = torch.eye(num_classes, dtype=torch.float64, device=labels.device)\n        options", ACD_TESTS),
    Swap("fedacd", "each later epoch's P: the previous epoch's estimate", "Sec. 4.1",
         "epoch 0's P all round", ACD,
         'P = probability_matrix(result.statistics["adjusted_ce.sums"], result.statistics["adjusted_ce.counts"])',
         "P = P", ACD_TESTS),
    Swap("fedacd", "lambda, the weight of L2", "Eq. 9", "1 whatever is configured", ACD,
         "MarginAdjustedCE(log_delta, p.margin_weight)", "MarginAdjustedCE(log_delta, 1.0)", ACD_TESTS),
    Swap("fedacd", "delta_missing, Delta of a class the client lacks", "Eq. 8 and after",
         "the default whatever is configured", ACD,
         "log_delta = log_adjustment(P, present, p.delta_missing, p.prob_floor, p.log_delta_clip)",
         "log_delta = log_adjustment(P, present, 1e-2, p.prob_floor, p.log_delta_clip)", ACD_TESTS),
    Swap("fedacd", "the mixed pair's form of Eq. 7 (flatten_mixed)", "Eq. 7 [D]", "the default whatever is configured",
         ACD, "Flattening(p.detach_target, p.flatten_mixed)", "Flattening(p.detach_target)", ACD_TESTS),
    Swap("fedacd", "the score's template tau", "Eq. 10-11", "the default whatever is configured", ACD,
         'kl = template_kl(result.statistics["fedacd.P"], present, self.params.template_tau)',
         'kl = template_kl(result.statistics["fedacd.P"], present)', ACD_TESTS),
    Swap("fedacd", "the score's P: the trained local model's (the last epoch's estimate, or the clean pass)",
         "Eq. 10", "the received model's P", ACD, 'final.statistics["fedacd.P"] = P',
         'final.statistics["fedacd.P"] = (local_probability_matrix(client.model, msg.arrays["model"], client.data, '
         'num_classes)[0] if present.any() else P)', ACD_TESTS),
    Swap("fedacd", "the aggregation weights: the scores V", "Eq. 11", "the sample sizes (FedAvg's)", ACD,
         'return [float(replies[c].scalars["score"]) for c in cids]', "return super().aggregation_weights(replies, cids)",
         ACD_TESTS),
]


def run_swap(swap: Swap, python: str, timeout: int) -> dict:
    path = ROOT / swap.file
    original = path.read_text()
    if original.count(swap.old) != 1:
        return {**asdict(swap), "result": "patch does not apply", "seconds": 0.0}
    t0 = time.monotonic()
    try:
        path.write_text(original.replace(swap.old, swap.new))
        # this checkout's src first, ahead of wherever the venv's editable install points
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", *swap.tests.split()],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        result = "survived" if done.returncode == 0 else "killed"
        # the first failing test and its error, so a reader can tell an assertion from a crash of the patch
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E   "))][:2]
    except subprocess.TimeoutExpired:
        result, failed = "killed (timeout)", []
    finally:
        path.write_text(original)
    return {**asdict(swap), "result": result, "by": failed, "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", help="only this method's swaps")
    p.add_argument("--list", action="store_true", help="print the list and run nothing")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--python", help="the interpreter with fedhet's dependencies (default: .venv/bin/python here)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wiring_mutants.json"))
    a = p.parse_args()
    swaps = [s for s in SWAPS if a.method in (None, s.method)]
    if a.list:
        print("| method | input | paper | wrong neighbour | tests |\n|---|---|---|---|---|")
        for s in swaps:
            print(f"| {s.method} | {s.input} | {s.where} | {s.wrong} | {s.tests} |")
        return 0
    python = a.python or str(ROOT / ".venv" / "bin" / "python")
    rows = []
    for s in swaps:
        row = run_swap(s, python, a.timeout)
        rows.append(row)
        print(f"{row['result']:>20}  {s.method}: {s.input} -> {s.wrong} ({row['seconds']} s)", flush=True)
    killed = sum(r["result"].startswith("killed") for r in rows)
    print(f"\n{killed} of {len(rows)} swaps killed")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    Path(a.out).write_text(json.dumps({"commit": commit, "killed": killed, "total": len(rows), "swaps": rows}, indent=1))
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
