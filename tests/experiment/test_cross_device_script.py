"""benchmarks/cross_device.py: the whole-run projection from hand-set rounds, and ``--limit``, which
stops a mode's run after the round during which its seconds ran out and keeps the rounds done."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import benchmark_script


@pytest.fixture(scope="module")
def script():
    return benchmark_script("cross_device")


def fake_clock(script, monkeypatch, readings):
    """The script's ``time.perf_counter`` reads ``readings`` in turn (its other time functions stay real)."""
    values = iter(readings)
    monkeypatch.setattr(script, "time", SimpleNamespace(perf_counter=lambda: next(values), strftime=time.strftime))


def row(total, evaluate, train, samples):
    return {"seconds": {"total": total, "evaluate": evaluate, "train": train, "aggregate": 0.0},
            "samples": samples, "global_acc": 0.5 if evaluate else None}


def test_whole_run_projected_from_the_rounds_measured(script, monkeypatch, tmp_path):
    rows = [row(10.0, 0.0, 9.0, 100), row(5.0, 2.0, 3.0, 300), row(4.0, 0.0, 4.0, 400)]
    exp = SimpleNamespace(run=lambda progress: None, run_dir=tmp_path, engine_info=lambda: {"engine": "fake"})
    monkeypatch.setattr(script.Experiment, "create", lambda cfg, folder, callbacks: exp)
    monkeypatch.setattr(script, "read_metrics", lambda folder: rows)
    fake_clock(script, monkeypatch, [0.0, 30.0])        # run start, run end: 30 s of wall time
    r = script.run_mode("reference:fp32", 3, "cpu", tmp_path, [])
    # start-up: 30 - (10 + 5 + 4) = 11 s. The first round is warm-up: per round without evaluation
    # (5 - 2, 4 - 0) -> 3.5 s; 1,500 rounds of it plus the config's 150 evaluations (every 10 rounds)
    # at the measured 2 s: 11 + 5,250 + 300 = 5,561 s
    assert r["startup_s"] == pytest.approx(11.0)
    assert r["whole_run_s"] == pytest.approx(5561.0) and r["projected"] is True
    # training samples/s over the measured rounds: (300 + 400) / (3 + 4)
    assert r["samples_per_s"] == pytest.approx(100.0)
    assert r["seconds_per_round"]["train"] == pytest.approx(3.5)
    assert r["evaluations_measured"] == 1 and r["final_global_acc"] == 0.5 and r["rounds"] == 3


def test_a_run_of_all_1500_rounds_is_its_wall_time(script, monkeypatch, tmp_path):
    rows = [row(1.0, 0.0, 1.0, 10)] * script.FULL_ROUNDS
    exp = SimpleNamespace(run=lambda progress: None, run_dir=tmp_path, engine_info=lambda: {})
    monkeypatch.setattr(script.Experiment, "create", lambda cfg, folder, callbacks: exp)
    monkeypatch.setattr(script, "read_metrics", lambda folder: rows)
    fake_clock(script, monkeypatch, [0.0, 1600.0])
    r = script.run_mode("reference:fp32", script.FULL_ROUNDS, "cpu", tmp_path, [])
    assert r["whole_run_s"] == 1600.0 and r["projected"] is False


@pytest.fixture
def tiny_config(script, small_config, tmp_path, monkeypatch):
    """The script's setting replaced by the synthetic data's 4-round run, evaluated every round."""
    raw = {**small_config, "train": {**small_config["train"], "rounds": 4}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(script, "CONFIG", path)
    return path


def test_limit_stops_after_the_round_it_ran_out_in_and_keeps_the_rounds(script, tiny_config, monkeypatch, tmp_path):
    # one reading a call: run start 0, the limit's start 1 (deadline 2.5), after round 1: 2, after
    # round 2: 3 (past the deadline: stop), run end 4
    fake_clock(script, monkeypatch, itertools.count())
    r = script.run_mode("reference:fp32", 4, "cpu", tmp_path, [], limit=1.5)
    assert r["rounds"] == 2 and r["projected"] is True and r["wall_s"] == 4
    rows = script.read_metrics(tmp_path / "reference-fp32")
    assert [x["round"] for x in rows] == [1, 2]
    assert r["samples_per_s"] == pytest.approx(rows[1]["samples"] / rows[1]["seconds"]["train"])


def test_limit_that_ends_in_the_first_round_leaves_nothing_to_time(script, tiny_config, monkeypatch, tmp_path):
    fake_clock(script, monkeypatch, itertools.count())
    assert script.run_mode("reference:fp32", 4, "cpu", tmp_path, [], limit=0.5) is None
    assert len(script.read_metrics(tmp_path / "reference-fp32")) == 1


def test_without_a_limit_every_round_runs(script, tiny_config, tmp_path):
    r = script.run_mode("reference:fp32", 4, "cpu", tmp_path, [])
    assert r["rounds"] == 4 and r["final_global_acc"] is not None


def test_a_real_interrupt_is_not_taken_for_the_limit(script, monkeypatch, tmp_path):
    def interrupted(progress):
        raise KeyboardInterrupt

    exp = SimpleNamespace(run=interrupted, run_dir=Path(tmp_path), engine_info=lambda: {})
    monkeypatch.setattr(script.Experiment, "create", lambda cfg, folder, callbacks: exp)
    with pytest.raises(KeyboardInterrupt):
        script.run_mode("reference:fp32", 3, "cpu", tmp_path, [], limit=100.0)
