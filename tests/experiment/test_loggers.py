"""run.loggers: what TensorBoard and MLflow hold is read back with each tool's own reader and
compared with metrics.jsonl (the source of truth)."""

from __future__ import annotations

import copy

import pytest
from helpers import run_killed_in_round

from fedhet.core.errors import ConfigError
from fedhet.experiment.config import load_config
from fedhet.experiment.loggers import row_scalars
from fedhet.experiment.runner import Experiment, read_metrics


def run_with(small_config, out, loggers, rounds=3):
    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = rounds
    raw["run"]["loggers"] = loggers
    exp = Experiment.create(load_config(raw=raw), out)
    exp.run(progress=False)
    return exp


def test_row_scalars_flatten_numbers_only():
    row = {"round": 2, "global_acc": 0.5, "clients": [1, 2], "ok": True, "x": None,
           "seconds": {"train": 1.5}, "comm": {"up/model": {"floats": 10, "bytes": 40}}}
    assert row_scalars(row) == {"global_acc": 0.5, "seconds/train": 1.5, "comm/up/model": 10.0}


def test_tensorboard_holds_every_round_of_metrics_jsonl(small_config, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    exp = run_with(small_config, tmp_path / "run", ["tensorboard"])
    rows = read_metrics(exp.run_dir)
    acc = EventAccumulator(str(exp.run_dir / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("accuracy/global_acc")
    assert [e.step for e in events] == [r["round"] for r in rows] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([r["global_acc"] for r in rows])
    assert [e.value for e in acc.Scalars("train_loss")] == pytest.approx([r["train_loss"] for r in rows])
    assert "comm/up/model" in acc.Tags()["scalars"]
    assert "config/text_summary" in acc.Tags()["tensors"]


def test_mlflow_run_holds_params_metrics_and_artifacts(small_config, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    exp = run_with(small_config, tmp_path / "run", ["mlflow"])
    rows = read_metrics(exp.run_dir)
    client = MlflowClient(tracking_uri=f"sqlite:///{(exp.run_dir / 'mlflow.db').resolve()}")
    run_id = (exp.run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.05" and run.data.params["algorithm.name"] == "fedavg"
    history = sorted(client.get_metric_history(run_id, "global_acc"), key=lambda m: m.step)
    assert [m.step for m in history] == [r["round"] for r in rows]
    assert [m.value for m in history] == pytest.approx([r["global_acc"] for r in rows])
    artifacts = {f.path for f in client.list_artifacts(run_id)}
    assert {"summary.json", "config.yaml", "accuracy.png"} <= artifacts


def test_resumed_run_continues_its_mlflow_run_and_tensorboard_curves(small_config, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 4
    raw["run"].update(loggers=["tensorboard", "mlflow"], checkpoint_every=2)
    exp = Experiment.create(load_config(raw=raw), tmp_path / "run")
    run_killed_in_round(exp, monkeypatch, 3)
    first_id = (exp.run_dir / "mlflow_run_id").read_text()
    resumed = Experiment.resume(exp.run_dir, run_settings=["train.rounds=5"])      # extended too
    resumed.run(progress=False)
    assert (exp.run_dir / "mlflow_run_id").read_text() == first_id
    acc = EventAccumulator(str(exp.run_dir / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("accuracy/global_acc")]
    assert steps == [1, 2, 3, 4, 5]             # round 3, recomputed after the checkpoint, is not doubled
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(exp.run_dir / 'mlflow.db').resolve()}")
    run_id = first_id.strip()
    assert [m.step for m in client.get_metric_history(run_id, "global_acc")] == [1, 2, 3, 4, 5]    # nor here
    assert client.get_run(run_id).data.tags["fedhet.rounds_planned"] == "5"


def test_unknown_logger_is_a_config_error(small_config):
    raw = copy.deepcopy(small_config)
    raw["run"]["loggers"] = ["wandb"]
    with pytest.raises(ConfigError, match="loggers"):
        load_config(raw=raw)
