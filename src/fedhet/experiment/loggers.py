"""Experiment tracking: TensorBoard and MLflow loggers selected by ``run.loggers``.

``metrics.jsonl`` stays the source of truth; a logger mirrors what the run writes there.

* ``tensorboard`` - event files in ``RUN_DIR/tensorboard``: every numeric value of a round's row
  as a scalar at step = round (``seconds/*`` and per-group ``comm/*`` floats included), the
  accuracy curves grouped under ``accuracy/``, and the resolved config as text. On resume,
  events after the checkpoint are purged so the curves are not doubled.
* ``mlflow`` - one MLflow run per fedhet run (resumes reuse it): the flattened config as
  params, every numeric value of a row as a metric at step = round, and at the end
  ``summary.json``, ``config.yaml`` and the plots as artifacts. The tracking store defaults to
  a SQLite file in the run directory (``RUN_DIR/mlflow.db``, artifacts in
  ``RUN_DIR/mlflow-artifacts``; MLflow 3 keeps its plain file store in maintenance mode);
  ``run.mlflow_tracking_uri`` points elsewhere (a server, another database).

Both need the optional extra ``pip install -e .[tracking]``.
"""

from __future__ import annotations

import json
import time

from fedhet.core.errors import ConfigError
from fedhet.experiment.callbacks import Callback, RunView
from fedhet.experiment.config import dump_config, flatten_config

ACCURACY_KEYS = ("global_acc", "global_val_acc", "global_labeldist_acc", "personal_acc", "personal_acc_pooled")
MLFLOW_RUN_ID = "mlflow_run_id"


def row_scalars(row: dict) -> dict[str, float]:
    """Every number of a metrics row by a flat name (``seconds/train``, ``comm/up/model``); lists,
    strings, booleans and ``None`` are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round":
            continue
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif key == "seconds" and isinstance(value, dict):
            out.update({f"seconds/{k}": float(v) for k, v in value.items() if isinstance(v, (int, float))})
        elif key == "comm" and isinstance(value, dict):
            out.update({f"comm/{k}": float(v["floats"]) for k, v in value.items() if isinstance(v, dict)})
    return out


def _missing(tool: str, package: str) -> ConfigError:
    return ConfigError(f"run.loggers lists {tool!r}, which needs {package}: pip install -e '.[tracking]' "
                       f"(or pip install {package}), or remove it from run.loggers")


class TensorBoardLogger(Callback):
    def __init__(self, exp: RunView):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        # purge_step: events of rounds after the checkpoint (recomputed on resume) are dropped
        self.writer = SummaryWriter(log_dir=str(exp.run_dir / "tensorboard"),
                                    purge_step=exp.start_round + 1 if exp.start_round else None)
        if exp.start_round == 0:
            self.writer.add_text("config", "```yaml\n" + dump_config(exp.cfg) + "```", 0)

    def on_row_written(self, exp: RunView, row: dict) -> None:
        step = row["round"]
        for name, value in row_scalars(row).items():
            tag = f"accuracy/{name}" if name in ACCURACY_KEYS else name
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def on_finished(self, exp: RunView, summary: dict) -> None:
        self.writer.add_text("summary", "```json\n" + json.dumps(summary, indent=2, default=str) + "\n```",
                             summary.get("rounds_completed", 0))
        self.writer.close()


class MlflowLogger(Callback):
    def __init__(self, exp: RunView):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow-skinny") from None
        run_dir = exp.run_dir.resolve()
        uri = exp.cfg.run.mlflow_tracking_uri or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        name = f"fedhet/{exp.cfg.name}"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = None if exp.cfg.run.mlflow_tracking_uri else (run_dir / "mlflow-artifacts").as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        id_file = run_dir / MLFLOW_RUN_ID
        # MLflow keeps every point logged, none can be removed: the rounds a resumed run recomputes
        # after its checkpoint (logged before the crash) are not logged again; metrics.jsonl holds
        # their recomputed values (which differ in the last bits where the run moved device or threads)
        self.logged_through = 0
        if exp.start_round and id_file.is_file():          # a resumed run continues its MLflow run
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            # seconds.total: every row has it (a row's train_loss may be None, and None is not logged)
            self.logged_through = max((m.step for m in self.client.get_metric_history(self.run_id, "seconds.total")),
                                      default=0)
        else:
            run = self.client.create_run(experiment_id, run_name=run_dir.name,
                                         tags={"fedhet.run_dir": str(run_dir), "fedhet.algorithm": exp.algorithm.name})
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id + "\n")
            from mlflow.entities import Param

            flat = flatten_config(exp.cfg.model_dump(mode="json"))
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000]) for k, v in flat.items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        # params cannot change: the rounds an extended run plans now are a tag
        self.client.set_tag(self.run_id, "fedhet.rounds_planned", str(exp.cfg.train.rounds))

    def on_row_written(self, exp: RunView, row: dict) -> None:
        from mlflow.entities import Metric

        if row["round"] <= self.logged_through:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(name.replace("/", "."), value, now, row["round"]) for name, value in row_scalars(row).items()]
        for i in range(0, len(metrics), 500):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 500])

    def on_finished(self, exp: RunView, summary: dict) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        for name in ("config.yaml", "accuracy.png", "partition.json"):
            path = exp.run_dir / name
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        status = {"completed": "FINISHED", "interrupted": "KILLED"}.get(summary.get("status", ""), "FAILED")
        self.client.set_terminated(self.run_id, status)


LOGGERS: dict[str, type[Callback]] = {"tensorboard": TensorBoardLogger, "mlflow": MlflowLogger}


def make_loggers(exp: RunView) -> list[Callback]:
    return [LOGGERS[name](exp) for name in exp.cfg.run.loggers]
