"""The mutation score of the last ``mutmut run`` (scripts/mutation.sh), with equivalent mutants set apart.

A mutant counts as *killed* when a test failed, timed out or crashed under it; as *survived* when
every test it ran passed, or when no test reached it. A survived mutant that cannot change what
the code computes (e.g. a ``.to(device)`` dropped, on the CPU where everything already lives) is
listed in ``scripts/mutation_equivalent.yaml`` with the changed lines and the reason; this script
checks that each listed mutant still makes exactly that change and leaves it out of the score.

    score = killed / (killed + survived)   (equivalent and not-yet-checked mutants are not judged)

    python scripts/mutation_score.py                    # table to stdout
    python scripts/mutation_score.py --out benchmarks/results/mutation   # also .md and .json
    python scripts/mutation_score.py --survivors        # every survivor's diff (to write tests)
    python scripts/mutation_score.py --mark NAME --why "..."   # list a survivor as equivalent

Run from the repository root after ``mutmut run`` (it reads ``mutants/``). Uses mutmut's own
readers (pinned in the ``mutation`` extra).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

try:  # installed by scripts/mutation.sh; --help needs none of it
    from mutmut.__main__ import SourceFileMutationData, walk_mutatable_files
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
except ImportError:
    MUTMUT_MISSING = True
else:
    MUTMUT_MISSING = False

EQUIVALENT = Path(__file__).with_name("mutation_equivalent.yaml")
KILLED = {"killed", "timeout", "segfault", "caught by type check"}


def changed_lines(diff: str) -> list[str]:
    """The removed and added lines of a mutant's diff, stripped (file headers left out)."""
    return [line[0] + " " + line[1:].strip() for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def load_results() -> dict[str, tuple[Path, str]]:
    """Every mutant of the configured files: name -> (source path, status)."""
    out = {}
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        for name, code in data.exit_code_by_key.items():
            out[name] = (Path(path), status_by_exit_code[code])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    ap.add_argument("--survivors", action="store_true", help="print every survivor's diff")
    ap.add_argument("--names", action="store_true",
                    help="print only the survivors' names, one a line (to re-check them: mutmut run NAME ...)")
    ap.add_argument("--file", default="", help="with --survivors / --names: only files whose path contains this")
    ap.add_argument("--mark", nargs="+", default=[], metavar="NAME", help="add these survivors to the equivalent list")
    ap.add_argument("--why", help="with --mark: why they cannot change behaviour")
    args = ap.parse_args()
    if MUTMUT_MISSING:
        raise SystemExit("mutation_score.py reads mutmut's results and needs mutmut: pip install -e '.[mutation]', "
                         "then bash scripts/mutation.sh")
    if not Path("mutants").is_dir():
        sys.exit("mutation_score.py: no mutants/ folder here; run `bash scripts/mutation.sh` from the repository root")
    results = load_results()
    if not results:
        sys.exit("mutation_score.py: mutants/ holds no results; run `bash scripts/mutation.sh` first")
    listed = yaml.safe_load(EQUIVALENT.read_text()) or []
    if args.mark:
        if not args.why:
            sys.exit("mutation_score.py: --mark needs --why (the reason no test can tell the mutant apart)")
        known = {e["mutant"] for e in listed}
        with EQUIVALENT.open("a") as f:
            for name in args.mark:
                if name not in results or name in known:
                    sys.exit(f"mutation_score.py: {name} is {'already listed' if name in known else 'not a mutant'}")
                change = changed_lines(get_diff_for_mutant(name, path=results[name][0]))
                f.write(yaml.safe_dump([{"mutant": name, "change": change, "why": args.why}], width=120,
                                       allow_unicode=True, sort_keys=False))
        return 0
    equivalent, stale = {}, []
    for entry in listed:
        name = entry["mutant"]
        if name not in results or results[name][1] in KILLED:
            stale.append(f"{name}: {'not a mutant now' if name not in results else 'killed now'}")
            continue
        now = changed_lines(get_diff_for_mutant(name, path=results[name][0]))
        if now != [line.strip() for line in entry["change"]]:
            stale.append(f"{name}: makes another change now: {now}")
            continue
        equivalent[name] = entry["why"]

    by_file: dict[str, Counter] = {}
    survivors = []
    for name, (path, status) in sorted(results.items()):
        kind = "equivalent" if name in equivalent else "killed" if status in KILLED else \
            "not checked" if status == "not checked" else "survived"
        by_file.setdefault(str(path), Counter())[kind] += 1
        if kind == "survived":                    # checked and not killed (incl. "no tests")
            survivors.append((name, path, status))
    total = Counter()
    for counts in by_file.values():
        total.update(counts)

    def score(c: Counter) -> float | None:
        judged = c["killed"] + c["survived"]          # not checked and equivalent mutants are not judged
        return c["killed"] / judged if judged else None

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rows = ["| file | mutants | killed | survived | not checked | equivalent | score |", "|---|---|---|---|---|---|---|"]
    for path, c in sorted(by_file.items()):
        rows.append(f"| {path} | {sum(c.values())} | {c['killed']} | {c['survived']} | {c['not checked']} | "
                    f"{c['equivalent']} | {pct(score(c))} |")
    rows.append(f"| **all** | {sum(total.values())} | {total['killed']} | {total['survived']} | "
                f"{total['not checked']} | {total['equivalent']} | **{pct(score(total))}** |")
    table = "\n".join(rows)
    if args.names:
        print("\n".join(n for n, p, _ in survivors if args.file in str(p)))
        return 0
    print(table)
    for line in stale:
        print(f"stale entry in {EQUIVALENT.name}: {line}", file=sys.stderr)
    if args.survivors:
        for name, path, status in survivors:
            if args.file not in str(path):
                continue
            print(f"\n## {name} ({status})")
            print("\n".join(changed_lines(get_diff_for_mutant(name, path=path))))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        machine = {"python": platform.python_version(), "machine": platform.machine(), "commit": commit}
        surv_md = "\n".join(f"- `{n}` ({s}): " + " / ".join(f"`{x}`" for x in changed_lines(
            get_diff_for_mutant(n, path=p))) for n, p, s in survivors) or "none"
        eq_md = "\n".join(f"- `{n}`: {why}" for n, why in sorted(equivalent.items())) or "none"
        args.out.with_suffix(".md").write_text(
            "# Mutation score of the seed methods' tests\n\n"
            "Command: `bash scripts/mutation.sh` (mutmut 3.8.1 over the files and tests of pyproject.toml's "
            "[tool.mutmut]), then `python scripts/mutation_score.py --out benchmarks/results/mutation`. "
            "killed = a test failed, timed out or crashed under the mutant; survived = every test it ran passed, "
            "or none reached it; not checked = not run yet; equivalent = cannot change behaviour "
            "(scripts/mutation_equivalent.yaml); score = killed / (killed + survived), over the mutants checked.\n\n"
            f"{table}\n\nSurvivors:\n\n{surv_md}\n\nEquivalent (left out of the score; "
            f"scripts/mutation_equivalent.yaml):\n\n{eq_md}\n\nCommit {commit}, Python {machine['python']}.\n")
        args.out.with_suffix(".json").write_text(json.dumps({
            "score": score(total), "totals": dict(total), "by_file": {p: dict(c) for p, c in by_file.items()},
            "survivors": [n for n, _, _ in survivors], "equivalent": equivalent,
            "stale": stale,
            "machine": machine}, indent=1))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
