"""FedFM's lambda, chosen by the rule the FedFM sweep files fix before their runs: lambda* = the
value whose seed-0 FedFM (CG) run reaches the highest validation accuracy (``global_val_acc``, the
union of the clients' held-out splits) in any round; a run stopped by a non-finite loss ranks last;
ties go to the larger lambda. A run that has not completed for another reason (still running,
failed otherwise) ranks last as well and is flagged: the rule is applied to finished runs.

    python benchmarks/fedfm_lambda_rule.py runs/fedfm_fmnist_full_niid2_r20_e1

Reads the folders ``fedfm_lam<lambda>_s0`` of a sweep's output; prints a Markdown table (best
validation accuracy and its round, the test accuracy at that round, the run's status) and lambda*.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedhet.experiment.rundir import read_metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    a = p.parse_args(argv)
    rows = []
    for d in sorted(a.folder.glob("fedfm_lam*_s0")):
        if not d.is_dir():
            continue
        lam = float(d.name.removeprefix("fedfm_lam").removesuffix("_s0"))
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
        metrics = [m for m in read_metrics(d) if m.get("global_val_acc") is not None]
        top = max(metrics, key=lambda m: m["global_val_acc"]) if metrics else None
        diverged = "non-finite" in str(summary.get("error") or "")
        finished = summary.get("status") == "completed" or diverged
        rows.append({"lam": lam, "status": summary.get("status", "no summary"), "diverged": diverged,
                     "finished": finished,
                     "val": top["global_val_acc"] if top else None, "round": top["round"] if top else None,
                     "test": top.get("global_acc") if top else None})
    if not rows:
        raise SystemExit(f"no fedfm_lam*_s0 folders in {a.folder}")
    # rank: completed before diverged or unfinished, then validation accuracy, then the larger lambda
    chosen = max(rows, key=lambda r: (r["finished"] and not r["diverged"], r["val"] if r["val"] is not None else -1.0,
                                      r["lam"]))
    print("| lambda | best validation accuracy (round) | test at that round (%) | status |")
    print("|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["lam"]):
        val = "-" if r["val"] is None else f"{r['val']:.4f} ({r['round']})"
        test = "-" if r["test"] is None else f"{100 * r['test']:.2f}"
        print(f"| {r['lam']:g} | {val} | {test} | {r['status']}{' (non-finite loss)' if r['diverged'] else ''} |")
    unfinished = [r for r in rows if not r["finished"]]
    print(f"\nlambda* = {chosen['lam']:g}" + (f" (provisional: {len(unfinished)} run(s) not finished)" if unfinished else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
