"""Feature-space quality (FedFM paper Table V: k-means NMI, silhouette) and the paper's
model-selection rule (test accuracy at the best-validation round)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from fedhet.cli import main as cli_main
from fedhet.core.errors import CheckpointError, ConfigError
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment
from fedhet.experiment.summary import model_selection
from fedhet.metrics.features import feature_quality, sample_positions


def clusters(spread: float, seed: int = 0):
    """Three classes of 60 points around (0,0), (10,0), (0,10) with the given spread."""
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    labels = np.repeat(np.arange(3), 60)
    return centres[labels] + spread * rng.standard_normal((180, 2)), labels


def test_separable_clusters_score_higher_than_mixed_ones():
    sep = feature_quality(*clusters(0.5), num_classes=3)
    mixed = feature_quality(*clusters(20.0), num_classes=3)
    assert sep["feature_nmi"] > 0.95 and sep["feature_silhouette"] > 0.8
    assert mixed["feature_nmi"] < 0.3 and mixed["feature_silhouette"] < 0.2


def test_silhouette_uses_the_true_classes():
    x, y = clusters(0.5)
    shuffled = np.random.default_rng(1).permutation(y)     # same points, labels unrelated to them
    assert feature_quality(x, shuffled, 3)["feature_silhouette"] < 0.05
    assert feature_quality(x, y, 3)["feature_silhouette"] > 0.8


def test_fewer_samples_than_classes_is_a_clear_error():
    features, labels = clusters(0.5)
    for n in (5, 10):
        with pytest.raises(ConfigError, match=f"into 10 classes and need more test samples than that; got {n}: raise"):
            feature_quality(features[:n], labels[:n], num_classes=10)
    for samples in ("0", "-3", "19"):           # below eval.features_samples' minimum
        with pytest.raises(SystemExit):
            cli_main(["features", "some_run", "--samples", samples])


def test_sample_positions_are_seeded_and_sorted():
    a, b = sample_positions(1000, 50, 3), sample_positions(1000, 50, 3)
    assert np.array_equal(a, b) and np.all(np.diff(a) > 0) and len(a) == 50
    assert len(sample_positions(10, 50)) == 10


def test_model_selection_reports_test_accuracy_at_the_best_validation_round():
    rows = [{"round": 1, "global_val_acc": 0.5, "global_acc": 0.4},
            {"round": 2, "global_val_acc": 0.8, "global_acc": 0.6},
            {"round": 3, "global_val_acc": 0.8, "global_acc": 0.7},    # tie: the first round wins
            {"round": 4, "global_val_acc": 0.7, "global_acc": 0.9}]    # best test, not selected
    sel = model_selection(rows)
    assert (sel["value"], sel["round"], sel["validation"]) == (0.6, 2, 0.8)
    assert "global_val_acc" in sel["rule"]
    assert model_selection([{"round": 1, "global_acc": 0.5}]) == {}


def test_run_records_validation_and_features_and_the_cli_reports_them(small_config, tmp_path, capsys):
    raw = copy.deepcopy(small_config)
    raw["data"]["local_test"] = {"source": "holdout", "fraction": 0.2}
    raw["train"]["rounds"] = 2
    raw["eval"]["features_every"] = 2
    raw["eval"]["features_samples"] = 60
    exp = Experiment.create(load_config(raw=raw), tmp_path / "run")
    summary = exp.run(progress=False)
    rows = exp.read_metrics()
    assert all(0 <= r["global_val_acc"] <= 1 for r in rows)
    # generic method: every client is tested with the global model on its held-out split, so the
    # pooled personal accuracy is the same validation accuracy
    assert rows[-1]["personal_acc_pooled"] == pytest.approx(rows[-1]["global_val_acc"])
    assert "feature_nmi" in rows[1] and "feature_nmi" not in rows[0]
    assert summary["model_selection"]["round"] in (1, 2)
    assert cli_main(["features", str(tmp_path / "run"), "--samples", "60"]) == 0
    report = json.loads((tmp_path / "run" / "features_round2.json").read_text())
    assert report["samples"] == 60 and (tmp_path / "run" / "features_round2.png").is_file()
    # the command recomputes what the run recorded for the same model and sample
    assert report["feature_nmi"] == pytest.approx(rows[1]["feature_nmi"])
    assert "NMI" in capsys.readouterr().out
    assert cli_main(["features", str(tmp_path / "run"), "--round", "1", "--no-plot"]) == 2   # only round 2 is kept
    assert "round 2 only" in capsys.readouterr().err
    # a plot that cannot be written keeps the numbers: the JSON is written before it
    (tmp_path / "run" / "features_round2.json").unlink()
    (tmp_path / "run" / "features_round2.png").unlink()
    (tmp_path / "run" / "features_round2.png").mkdir()
    assert cli_main(["features", str(tmp_path / "run"), "--samples", "60"]) == 2
    assert "cannot write the plot" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "features_round2.json").read_text())["feature_nmi"] == report["feature_nmi"]


def test_features_without_checkpoint_says_what_to_do(small_config, tmp_path):
    raw = copy.deepcopy(small_config)
    Experiment.create(load_config(raw=raw), tmp_path / "run")      # created, never run
    with pytest.raises(CheckpointError, match="checkpoint_every"):
        from fedhet.experiment.features import features_report
        features_report(tmp_path / "run")


def test_features_of_a_run_without_a_global_test_set_say_which_runs_have_one(small_config):
    from fedhet.data.federated import build_federation
    from fedhet.metrics.features import global_test_features

    raw = copy.deepcopy(small_config)
    raw["data"].update(pool="train+test", local_test={"source": "holdout", "fraction": 0.2})
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert fed.test is None
    with pytest.raises(ConfigError, match=r"train\+test puts the test split into the clients' data\): they need a "
                                          r"run made with data.pool: train"):
        global_test_features(None, {}, fed)
