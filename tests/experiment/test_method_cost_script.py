"""benchmarks/method_cost.py: the medians and ratios it reports from hand-set round timings, the
rotating order of the tags, a refused tag, and one real measurement on the synthetic data, where
every tag must train the same clients' sample-steps."""

from __future__ import annotations

import json

import pytest
from helpers import benchmark_script, write_sweep


@pytest.fixture(scope="module")
def script():
    return benchmark_script("method_cost")


@pytest.fixture
def sweep_file(tmp_path, small_config):
    return write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})])


def test_medians_ratios_and_the_rotating_order_from_set_timings(script, sweep_file, tmp_path, monkeypatch, capsys):
    # seconds of each tag's rounds in call order: warm-up first, then the measured rounds
    seconds = {"fedavg": [9.0, 2.0, 4.0, 1.0], "fedprox": [9.0, 2.5, 10.0, 8.0]}
    calls: list[tuple[str, list[str]]] = []

    def fake_round(job, clients, extra_set, workdir):
        calls.append((job.tag, extra_set))
        return 400, seconds[job.tag].pop(0)

    monkeypatch.setattr(script, "one_round", fake_round)
    assert script.main([str(sweep_file), "--only", "fedavg", "fedprox", "--repeats", "3",
                        "--set", "run.memory_format=channels_last", "--out", str(tmp_path / "res"),
                        "--name", "t"]) == 0
    # warm-up in the given order, then repeats starting at the first, second, first tag
    assert [tag for tag, _ in calls] == ["fedavg", "fedprox", "fedavg", "fedprox", "fedprox", "fedavg",
                                         "fedavg", "fedprox"]
    assert all(extra == ["run.memory_format=channels_last"] for _, extra in calls)
    record = json.loads((tmp_path / "res" / "method_cost_t.json").read_text())
    fedavg, fedprox = record["rows"]
    # fedavg: 400/2, 400/4, 400/1 -> 200, 100, 400 samples/s, median 200; fedprox: 160, 40, 50 -> median 50.
    # Its ratio pairs each repeat: 160/200, 40/100, 50/400 -> 0.8, 0.4, 0.125, median 0.4 (the medians'
    # ratio, 50/200, would be 0.25)
    assert fedavg["samples_per_s_all"] == [200.0, 100.0, 400.0]
    assert fedavg["samples_per_s"] == 200.0 and fedavg["ratio"] == 1.0 and fedavg["ratios"] == [1.0, 1.0, 1.0]
    assert fedprox["samples_per_s_all"] == [160.0, 40.0, 50.0]
    assert fedprox["samples_per_s"] == 50.0
    assert fedprox["ratios"] == pytest.approx([0.8, 0.4, 0.125]) and fedprox["ratio"] == pytest.approx(0.4)
    table = (tmp_path / "res" / "method_cost_t.md").read_text()
    assert "| fedprox | 400 | 50 | 40-160 | 0.40x | 0.12-0.80 |" in table
    assert "--set run.memory_format=channels_last" in table
    assert "fedprox: 50 samples/s (40-160), 0.40x fedavg (0.12-0.80)" in capsys.readouterr().out


def test_a_tag_the_sweep_lacks_is_refused_with_its_tags(script, sweep_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(script, "one_round", lambda *a: pytest.fail("measured before checking --only"))
    with pytest.raises(SystemExit) as stop:
        script.main([str(sweep_file), "--only", "fedavg", "fedpox", "--out", str(tmp_path / "res")])
    assert stop.value.code == 2
    assert "--only fedpox: not a tag of" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_a_real_round_of_two_methods_trains_the_same_sample_steps(script, sweep_file, tmp_path):
    assert script.main([str(sweep_file), "--only", "fedprox", "fedavg", "--repeats", "1",
                        "--out", str(tmp_path / "res"), "--name", "real"]) == 0
    rows = json.loads((tmp_path / "res" / "method_cost_real.json").read_text())["rows"]
    assert [r["tag"] for r in rows] == ["fedprox", "fedavg"]
    assert rows[0]["sample_steps"] == rows[1]["sample_steps"] > 0
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
