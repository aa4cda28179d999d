"""benchmarks/local_confidence.py: the split of P's rows into true, other-present and absent mass,
hand-computed; its rule's three outcomes; and a run on the synthetic data, whose clients and figures
must agree across methods and with the local KL that ``eval.local_risk`` records."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import benchmark_script

from fedhet.metrics.evaluate import local_model_risk


@pytest.fixture(scope="module")
def script():
    return benchmark_script("local_confidence")


def test_the_mass_of_the_present_rows_splits_into_true_other_and_absent(script):
    P = torch.tensor([[0.6, 0.2, 0.1, 0.1],
                      [0.1, 0.5, 0.3, 0.1],
                      [0.3, 0.3, 0.2, 0.2],       # rows 2 and 3: classes the client lacks, left out
                      [0.1, 0.1, 0.1, 0.7]])
    split = script.mass_split(P, torch.tensor([True, True, False, False]))
    assert split["true"] == pytest.approx(0.55)            # (0.6 + 0.5) / 2
    assert split["other_present"] == pytest.approx(0.15)   # (0.2 + 0.1) / 2
    assert split["absent"] == pytest.approx(0.3)           # (0.2 + 0.4) / 2
    with pytest.raises(ValueError, match="present class"):
        script.mass_split(P, torch.zeros(4, dtype=torch.bool))


@pytest.mark.parametrize(("true", "absent", "outcome"), [
    (0.8, 0.08, "holds"), (0.8, 0.04, "inconclusive"), (0.8, 0.01, "does not hold"),
    (0.95, 0.08, "inconclusive"),          # more absent mass, but no more mass off the true class
])
def test_the_rule_asks_for_half_of_the_extra_off_true_mass_on_absent_classes(script, true, absent, outcome):
    # at true 0.8: 0.1 more mass off the true class; the absent mass must carry at least 0.05 of it
    means = {"fedavg": {"true": 0.9, "absent": 0.02}, "fedlc": {"true": true, "absent": absent}}
    assert script.verdict(means, "fedavg", "fedlc").startswith(outcome)


def write_config(path, small_config, algorithm: str) -> str:
    raw = {**small_config, "name": algorithm, "algorithm": {"name": algorithm}}
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_run_measures_every_method_on_the_same_clients(script, small_config, tmp_path, capsys):
    runs = [write_config(tmp_path / f"{a}.yaml", small_config, a) for a in ("fedavg", "fedlc")]
    assert script.main([*runs, "--start-rounds", "1", "--out", str(tmp_path / "out"), "--name", "lc"]) == 0
    record = json.loads((tmp_path / "out" / "lc.json").read_text())
    fedavg, fedlc = (record["results"][a]["clients"] for a in ("fedavg", "fedlc"))
    assert [r["client"] for r in fedavg] == [r["client"] for r in fedlc]
    assert len(fedavg) == small_config["train"]["clients_per_round"]
    assert record["measured_round"] == 2                  # after one start round, as metrics.jsonl counts
    for row in fedavg + fedlc:
        assert row["true"] + row["other_present"] + row["absent"] == pytest.approx(1.0, abs=1e-6)
    assert record["verdict"].split(":")[0] in ("holds", "inconclusive", "does not hold")
    assert "| fedlc | 3 |" in (tmp_path / "out" / "lc.md").read_text()
    assert "hypothesis (fedlc keeps mass on absent classes)" in capsys.readouterr().out


def test_the_local_kl_is_what_eval_local_risk_records_for_the_uploaded_models(script, small_config, tmp_path):
    cfg = script.load_run_config(write_config(tmp_path / "fedavg.yaml", small_config, "fedavg"), [])
    start = script.start_weights(cfg, 0)
    built, kept = script.local_models(cfg, start, 0)
    recorded = local_model_risk(built.models, built.client_arch, kept, built.federation)["local_kl_by_client"]
    rows = script.measure(built, kept)
    assert {r["client"]: r["local_kl"] for r in rows} == recorded      # the same passes, bit for bit
    cid = rows[0]["client"]
    start_model = start[built.client_arch[cid]]
    assert any(not torch.equal(kept[cid][k], start_model[k]) for k in start_model)      # it trained


def test_a_method_that_uploads_part_of_its_model_is_refused(script, small_config, tmp_path):
    runs = [write_config(tmp_path / f"{a}.yaml", small_config, a) for a in ("fedavg", "fedper")]
    with pytest.raises(SystemExit, match="fedper uploads no whole local model"):
        script.main([*runs, "--start-rounds", "0", "--out", str(tmp_path / "out")])


def test_runs_of_different_partitions_are_refused(script, small_config, tmp_path, capsys):
    other = {**small_config, "seed": small_config["seed"] + 1}
    runs = [write_config(tmp_path / "fedavg.yaml", small_config, "fedavg"),
            write_config(tmp_path / "fedlc.yaml", other, "fedlc")]
    with pytest.raises(SystemExit):
        script.main([*runs, "--out", str(tmp_path / "out")])
    assert "data sections, seeds or train.clients_per_round differ" in capsys.readouterr().err


def test_a_misspelt_compare_is_refused_before_any_training(script, small_config, tmp_path, capsys, monkeypatch):
    runs = [write_config(tmp_path / f"{a}.yaml", small_config, a) for a in ("fedavg", "fedlc")]
    monkeypatch.setattr(script, "start_weights", lambda *a: pytest.fail("trained before checking --compare"))
    with pytest.raises(SystemExit):
        script.main([*runs, "--compare", "fedavg", "fedcl", "--out", str(tmp_path / "out")])
    assert "--compare names fedcl" in capsys.readouterr().err
