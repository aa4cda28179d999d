"""Loading LEAF's FEMNIST JSON: a first load (parsing every file) against later loads, and
against the loader of an earlier commit, each in a fresh process: wall seconds and peak RSS.

    python benchmarks/leaf_loading.py                       # synthetic LEAF files, this checkout only
    python benchmarks/leaf_loading.py --before 590fe3f      # also the loader of that commit
    python benchmarks/leaf_loading.py --data /path/to/root  # real data: ROOT/femnist/{train,test}/*.json

The synthetic files are written as LEAF writes FEMNIST: every pixel a JSON float, white
background (1.0) and about a fifth of the pixels ink of any grey level; 100 writers of 200
images a file (LEAF's files hold about 20,000 images). Each side loads the train and the test
split (``load_splits``, as a run does) with its own empty cache folder; "cached" is a second
process on the same cache. Writes ``benchmarks/results/leaf_loading.{md,json}`` (``--out``)
with the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_synthetic(root: Path, files: int, writers: int, per_writer: int) -> int:
    import numpy as np

    rng = np.random.default_rng(0)
    for split, share in (("train", 0.9), ("test", 0.1)):
        (root / "femnist" / split).mkdir(parents=True, exist_ok=True)
        for f in range(files):
            users = {}
            for w in range(writers):
                n = max(1, round(share * per_writer))
                x = np.ones((n, 784))
                ink = rng.random((n, 784)) < 0.2
                x[ink] = rng.integers(0, 255, int(ink.sum())) / 255.0
                users[f"f{f:02d}{w:03d}_00"] = {"x": x.tolist(), "y": rng.integers(0, 62, n).tolist()}
            doc = {"users": list(users), "num_samples": [len(u["y"]) for u in users.values()], "user_data": users}
            (root / "femnist" / split / f"all_data_{f}_niid_{split}.json").write_text(json.dumps(doc))
    return sum(p.stat().st_size for p in (root / "femnist").rglob("*.json"))


def child(data: Path, cache: Path) -> None:
    """One load in this process; prints a JSON line: seconds, peak RSS, images."""
    t0 = time.perf_counter()
    from fedhet.data.datasets import femnist, load_splits

    if hasattr(femnist, "_leaf_cache_dir"):
        femnist._leaf_cache_dir = lambda: cache       # noqa: SLF001 (the cache folder of this side)
    train, test = load_splits("femnist", str(data))
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's at the fork (Linux), and
    # the parent held the synthetic files' text
    hwm_kb = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith("VmHWM:"))
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 3), "images": len(train.y) + len(test.y),
                      "peak_rss_mb": round(hwm_kb / 1024, 1)}))


def load_in_child(src: Path, data: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, __file__, "--child", str(data), str(cache)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def archived_src(rev: str, folder: Path) -> tuple[Path, str]:
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", short, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    folder.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src", short


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="a folder holding femnist/{train,test}/*.json (default: synthetic)")
    p.add_argument("--files", type=int, default=2, help="synthetic files per split")
    p.add_argument("--writers", type=int, default=100, help="synthetic writers per file")
    p.add_argument("--per-writer", type=int, default=200, help="synthetic images per writer (train + test)")
    p.add_argument("--before", help="also load with the loader of this commit")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "leaf_loading")
    p.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return 0
    work = Path(tempfile.mkdtemp(prefix="leaf-bench-"))
    try:
        data = a.data
        if data is None:
            data = work / "data"
            print(f"writing synthetic LEAF files to {data} ...", flush=True)
            written = write_synthetic(data, a.files, a.writers, a.per_writer)
        else:
            written = sum(p.stat().st_size for p in (data / "femnist").rglob("*.json"))
        rows = []
        sides = [("this checkout", ROOT / "src")]
        if a.before:
            src, short = archived_src(a.before, work / "before")
            sides.insert(0, (f"commit {short}", src))
        for label, src in sides:
            cache = work / f"cache-{len(rows)}"
            first = load_in_child(src, data, cache)
            rows.append({"loader": label, "load": "first (parses the JSON)", **first})
            print(rows[-1], flush=True)
            if label == "this checkout":
                again = load_in_child(src, data, cache)
                rows.append({"loader": label, "load": "cached (a later process)", **again})
                print(rows[-1], flush=True)
        sys.path.insert(0, str(ROOT / "src"))
        from fedhet.experiment.summary import machine_info

        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        result = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
                  "commit": head, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(),
                  "data": str(a.data) if a.data else f"synthetic: {a.files} files a split x {a.writers} writers x "
                                                     f"{a.per_writer} images (90% train)",
                  "json_mb": round(written / 1e6, 1), "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = result["machine"]
    lines = [f"# Loading LEAF FEMNIST JSON ({result['data']}, {result['json_mb']} MB of JSON)", "",
             f"`{result['command']}` at {result['commit']}, {result['date']}; {m.get('cpu_model', m['processor'])} "
             f"({m.get('cpu_isa', '?')}), {m.get('cpus', '?')} CPUs, python {m['python']}. Each load is a fresh "
             "process loading both splits (`load_splits`); peak RSS is the process's VmHWM.", "",
             "| loader | load | images | seconds | peak RSS (MB) |", "|---|---|---|---|---|"]
    lines += [f"| {r['loader']} | {r['load']} | {r['images']:,} | {r['seconds']:.2f} | {r['peak_rss_mb']:,.0f} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
