"""benchmarks/gpu_sweeps.sh, in its dry run on the CPU: a sweep on the device starts only the runs
its committed folder lacks, and what it brings back adopts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import write_sweep

from fedhet.experiment.sweep import adopt_runs, job_status, load_sweep, run_sweep

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_sweeps.sh"

# the sweep is pinned to every CPU of this machine and would give its one lane all of them, beside
# the other test workers (tests/conftest.py, sweep_lanes_plan_for_one_cpu)
ONE_THREAD = "--set run.threads=1"

pytestmark = pytest.mark.skipif(shutil.which("taskset") is None, reason="gpu_sweeps.sh pins sweeps with taskset")


def tiny_sweep(tmp_path, small_config) -> Path:
    """Two one-lane runs of two rounds (fedavg_s0, fedprox_s0) into tmp_path/out."""
    return write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], lanes=1, set=["train.rounds=2"])


def dry_run(spec: str, out: Path, seconds: int = 240) -> subprocess.CompletedProcess:
    # the settings of a gpu_check.sh or gpu_sweeps.sh call this test may run under are not this call's
    outer = ("PYTEST_SECONDS", "PYTEST_FILES", "FEDHET_TEST_DEVICE", "SWEEP_LANES", "GPU_SWEEPS_DEVICE")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    env.update({"GPU_SWEEPS_DEVICE": "cpu", "OUT": str(out), "SWEEP_LANES": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    return subprocess.run(["bash", str(SCRIPT), str(seconds), spec], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=seconds + 120)


def test_a_device_sweep_brings_back_the_missing_runs_and_never_undoes_a_committed_one(tmp_path, small_config):
    """One sweep's life: the device starts only the run its committed folder lacks, what it brings
    back adopts, and a later call given an archive that holds an unfinished copy of a run committed
    since (--from=ARCHIVE) leaves the committed run alone. One scenario, so that its two runs train once."""
    path = tiny_sweep(tmp_path, small_config)
    run_sweep(load_sweep(path), only=["fedavg"], log=lambda m: None, poll_seconds=0.2)   # "committed"
    committed = load_sweep(path).jobs[0].run_dir / "metrics.jsonl"
    before = committed.read_bytes()

    done = dry_run(f"--lanes 1 {path} {ONE_THREAD}", tmp_path / "device_out")     # options before the file too
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "device_out" / "sweep0.log").read_text()
    assert "2 runs, 1 completed left alone, 1 to run" in log, log
    assert "start  fedprox_s0" in log and "start  fedavg_s0" not in log, log

    archive = tmp_path / "device_out" / "sweep0.tar.gz"
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        summary = json.load(tar.extractfile("sweep0/fedprox_s0/summary.json"))   # type: ignore[arg-type]
    assert summary["status"] == "completed" and summary["device"] == "cpu"
    assert "sweep0/fedavg_s0/metrics.jsonl" in names        # the committed run travels back unchanged

    sweep = load_sweep(path)
    assert adopt_runs(sweep, archive, log=lambda m: None) == ["fedprox_s0"]
    assert {j.name: job_status(j) for j in sweep.jobs} == {"fedavg_s0": "completed", "fedprox_s0": "completed"}
    assert committed.read_bytes() == before

    # Both runs committed now; an archive from an earlier call holds fedavg_s0 unfinished.
    unfinished = tmp_path / "archive" / "sweep0"
    shutil.copytree(tmp_path / "out", unfinished)
    summary_file = unfinished / "fedavg_s0" / "summary.json"
    summary_file.write_text(json.dumps({**json.loads(summary_file.read_text()), "status": "interrupted"}))
    with tarfile.open(tmp_path / "sweep0.tar.gz", "w:gz") as tar:
        tar.add(unfinished, arcname="sweep0")

    done = dry_run(f"{path} --lanes 1 --from={tmp_path / 'sweep0.tar.gz'} {ONE_THREAD}", tmp_path / "device_out2")
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "device_out2" / "sweep0.log").read_text()
    assert "2 runs, 2 completed left alone, 0 to run" in log, log


def test_a_sweep_file_the_device_cannot_read_stops_the_call_before_anything_runs(tmp_path):
    done = dry_run(f"{tmp_path / 'missing.sweep.yaml'} --lanes 1", tmp_path / "device_out", seconds=30)
    assert done.returncode == 2
    assert "cannot read the sweep file" in done.stderr
    assert not (tmp_path / "device_out" / "sweep0.log").exists()
