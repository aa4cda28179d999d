"""benchmarks/method_cost.py: the medians and ratios it reports from hand-set round timings, the
rotating order of the tags, what it refuses, and real measurements on the synthetic data, whose
rounds must train the sample-steps of a plain run's round of as many clients, and with --round 2 a
FedClassAvg round without its first participation's pre-training epoch."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from helpers import benchmark_script, write_sweep

import fedhet


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

    def fake_round(job, clients, extra_set, workdir, measured_round):
        calls.append((job.tag, extra_set))
        return {"samples": 400, "train": seconds[job.tag].pop(0), "aggregate": 0.25, "phases": 1}

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
    assert fedavg["samples_per_s"] == 200.0
    assert fedprox["samples_per_s_all"] == [160.0, 40.0, 50.0]
    assert fedprox["samples_per_s"] == 50.0
    assert fedprox["ratios"] == pytest.approx([0.8, 0.4, 0.125]) and fedprox["ratio"] == pytest.approx(0.4)
    table = (tmp_path / "res" / "method_cost_t.md").read_text()
    assert "| fedprox | 400 | 1 | 50 | 40-160 | 0.40x | 0.12-0.80 | 0.25 |" in table
    assert "--set run.memory_format=channels_last" in table
    assert "Every tag's round trained the same sample-steps." in table
    assert "fedprox: 50 samples/s (40-160), 0.40x fedavg (0.12-0.80)" in capsys.readouterr().out


def test_set_for_reaches_only_its_tag_after_the_common_set(script, sweep_file, tmp_path, monkeypatch):
    calls: list[tuple[str, list[str]]] = []

    def fake_round(job, clients, extra_set, workdir, measured_round):
        calls.append((job.tag, extra_set))
        return {"samples": 400, "train": 1.0, "aggregate": 0.0, "phases": 1}

    monkeypatch.setattr(script, "one_round", fake_round)
    script.main([str(sweep_file), "--only", "fedavg", "fedprox", "--repeats", "1", "--set", "run.precision=bf16",
                 "--set-for", "fedprox", "algorithm.params.mu=0.5", "--out", str(tmp_path), "--name", "f"])
    expected = {"fedavg": ["run.precision=bf16"], "fedprox": ["run.precision=bf16", "algorithm.params.mu=0.5"]}
    assert len(calls) == 4                                   # warm-up and one repeat each
    assert all(extra == expected[tag] for tag, extra in calls)
    assert "--set-for fedprox algorithm.params.mu=0.5" in (tmp_path / "method_cost_f.md").read_text()
    record = json.loads((tmp_path / "method_cost_f.json").read_text())
    assert record["set_for"] == {"fedprox": ["algorithm.params.mu=0.5"]}
    assert [r["set_for"] for r in record["rows"]] == [[], ["algorithm.params.mu=0.5"]]


def test_set_for_a_tag_not_measured_is_refused(script, sweep_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(script, "one_round", lambda *a: pytest.fail("measured before checking --set-for"))
    with pytest.raises(SystemExit) as stop:
        script.main([str(sweep_file), "--only", "fedavg", "--set-for", "fedprox", "algorithm.params.mu=0.5",
                     "--out", str(tmp_path / "res")])
    assert stop.value.code == 2
    assert "--set-for fedprox: not a tag of --only (fedavg)" in capsys.readouterr().err


def test_rounds_of_other_sample_steps_are_said_to_differ(script, sweep_file, tmp_path, monkeypatch):
    monkeypatch.setattr(script, "one_round", lambda job, *a: {"samples": 400 if job.tag == "fedavg" else 500,
                                                             "train": 1.0, "aggregate": 0.0, "phases": 1})
    script.main([str(sweep_file), "--only", "fedavg", "fedprox", "--repeats", "1", "--out", str(tmp_path), "--name", "d"])
    assert "The tags' rounds trained different sample-steps" in (tmp_path / "method_cost_d.md").read_text()
    assert json.loads((tmp_path / "method_cost_d.json").read_text())["same_sample_steps"] is False


def test_a_tag_the_sweep_lacks_is_refused_with_its_tags(script, sweep_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(script, "one_round", lambda *a: pytest.fail("measured before checking --only"))
    with pytest.raises(SystemExit) as stop:
        script.main([str(sweep_file), "--only", "fedavg", "fedpox", "--out", str(tmp_path / "res")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--only fedpox: not a tag of" in err and "its tags: fedavg, fedprox" in err
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("given", [["--set", "train.rounds=3"], ["--set", "run.engine=parallel"],
                                   ["--set", " run.threads =2"], ["--set-for", "fedavg", "run.engine=parallel"]])
def test_a_set_of_what_the_measurement_fixes_is_refused_by_its_flag(script, sweep_file, tmp_path, monkeypatch,
                                                                    capsys, given):
    monkeypatch.setattr(script, "one_round", lambda *a: pytest.fail("measured before checking --set"))
    with pytest.raises(SystemExit) as stop:
        script.main([str(sweep_file), "--only", "fedavg", *given, "--out", str(tmp_path / "res")])
    assert stop.value.code == 2
    assert f"{' '.join(given)}: the measurement fixes train.rounds" in capsys.readouterr().err


def test_tags_that_start_with_other_seeds_are_refused(script, small_config, tmp_path, monkeypatch, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {"seeds": [1]})])
    monkeypatch.setattr(script, "one_round", lambda *a: pytest.fail("measured tags of other seeds"))
    with pytest.raises(SystemExit):
        script.main([str(path), "--only", "fedavg", "fedprox", "--out", str(tmp_path / "res")])
    assert "first seeds differ (fedavg: 0, fedprox: 1)" in capsys.readouterr().err


def test_a_real_round_trains_what_a_plain_round_of_as_many_clients_does(script, sweep_file, tmp_path):
    # the config has 3 clients a round; the script's default --clients 2 must replace it
    assert script.main([str(sweep_file), "--only", "fedprox", "fedavg", "--repeats", "1",
                        "--out", str(tmp_path / "res"), "--name", "real"]) == 0
    rows = json.loads((tmp_path / "res" / "method_cost_real.json").read_text())["rows"]
    assert [r["tag"] for r in rows] == ["fedprox", "fedavg"]
    plain = fedhet.run(str(tmp_path / "fedavg.yaml"), ["seed=0", "train.rounds=1", "train.clients_per_round=2",
                                                       "run.progress=false"], out=tmp_path / "plain").rows[0]
    assert rows[0]["sample_steps"] == rows[1]["sample_steps"] == plain["samples"]
    assert (tmp_path / "res" / "method_cost_real.md").exists()


def test_round_2_of_a_whole_federation_leaves_out_fedclassavgs_pretraining_epoch(script, small_config, tmp_path):
    # FedClassAvg pre-trains a client for one epoch at its first participation: with all 6 clients in
    # the round, round 1 trains two epochs of every client, round 2 one (the same batches, drop_last)
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": ["fca_tiny_a", "fca_tiny_b", "fca_tiny_c"]}
    raw["algorithm"] = {"name": "fedclassavg"}
    raw["train"].update(optimizer="adam", betas=[0.5, 0.999], lr=1e-3, momentum=0.0)
    (tmp_path / "fca.yaml").write_text(yaml.safe_dump(raw))
    path = write_sweep(tmp_path, small_config, [(str(tmp_path / "fca.yaml"), {"tag": "fca"})])
    steps = {}
    for measured in (1, 2):
        argv = [str(path), "--only", "fca", "--clients", "6", "--repeats", "1", "--out", str(tmp_path / "res"),
                "--name", f"r{measured}", *(["--round", "2"] if measured == 2 else [])]
        assert script.main(argv) == 0
        record = json.loads((tmp_path / "res" / f"method_cost_r{measured}.json").read_text())
        assert record["round"] == measured
        steps[measured] = record["rows"][0]["sample_steps"]
    assert steps[1] == 2 * steps[2] > 0
    table = (tmp_path / "res" / "method_cost_r2.md").read_text()
    assert "--round 2" in table and "Round 2 (the last, so evaluated)" in table


def test_a_round_below_1_is_refused(script, sweep_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(script, "one_round", lambda *a: pytest.fail("measured round 0"))
    with pytest.raises(SystemExit) as stop:
        script.main([str(sweep_file), "--only", "fedavg", "--round", "0", "--out", str(tmp_path / "res")])
    assert stop.value.code == 2
    assert "--round must be at least 1" in capsys.readouterr().err
