"""Running an experiment: config -> federation -> models -> algorithm -> rounds -> run directory.

A run directory holds everything a reader needs and survives a crash:

  config.yaml      the resolved config (every default filled in)
  metrics.jsonl    one line per evaluated round, appended and flushed as it happens
  checkpoint.pt    server + client state every ``run.checkpoint_every`` rounds (atomic replace)
  summary.json     best/final values with the rule that chose them, speed, memory, communication
  accuracy.png     the accuracy curves
  partition.json   per-client train/test label counts
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

import pydantic
import torch

from fedhet import __version__
from fedhet.algorithms import algorithm_class
from fedhet.algorithms.base import Algorithm
from fedhet.algorithms.local import TrainSettings, auto_precision, bf16_native
from fedhet.data.federated import Federation, build_federation
from fedhet.engine import engine_info, make_engine
from fedhet.errors import CheckpointError, ConfigError, FedhetError
from fedhet.experiment.config import ExperimentConfig, dump_config, load_config
from fedhet.metrics.evaluate import evaluate
from fedhet.metrics.ledger import tensor_floats
from fedhet.models import build_model
from fedhet.seeding import derive_seed

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


def make_algorithm(cfg: ExperimentConfig) -> Algorithm:
    try:
        cls = algorithm_class(cfg.algorithm.name)
    except KeyError as e:
        raise ConfigError(f"algorithm.name: {e.args[0]}") from None
    try:
        params = cls.Params.model_validate(cfg.algorithm.params)
    except pydantic.ValidationError as e:
        bad = "; ".join(f"algorithm.params.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ConfigError(f"{bad} (accepted parameters of {cls.name}: {', '.join(cls.Params.model_fields) or 'none'})") from None
    return cls(params)


def build_models(cfg: ExperimentConfig, fed: Federation) -> tuple[dict[str, torch.nn.Module], list[str]]:
    """One model instance per architecture, initialised from the run seed; client i gets archs[i % n]."""
    archs = cfg.model.archs()
    models = {}
    for arch in dict.fromkeys(archs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "init", arch))
            try:
                models[arch] = build_model(arch, in_channels=fed.in_channels, num_classes=fed.num_classes,
                                           image_size=fed.image_size, split=cfg.model.split, norm=cfg.model.norm,
                                           **cfg.model.options)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"model: {e}") from None
    return models, [archs[i % len(archs)] for i in range(fed.num_clients)]


def resolve_precision(requested: str, device: str = "cpu") -> str:
    # 'auto' means bf16 only where the hardware runs it natively AND local.AUTO_BF16 is on (it is,
    # since the bf16 accuracy check passed; docs/performance.md).
    return auto_precision(device) if requested == "auto" else requested


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "fedhet": __version__, "commit": git_commit()}


def peak_memory_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def headline_metric(algorithm: Algorithm, federation: Federation) -> str:
    """personal_acc for personalized methods and wherever there is no global test set (train+test
    pooled, FedReMa's protocol, where FedAvg's global model is tested on the local splits); else global_acc."""
    if algorithm.personalized or not algorithm.has_global_model or federation.test is None:
        return "personal_acc"
    return "global_acc"


def summarize_metrics(rows: list[dict], metric: str, window: int) -> dict:
    """Best (max over evaluated rounds) and final (mean of the last ``window`` evaluations) of ``metric``."""
    values = [(r["round"], r[metric]) for r in rows if r.get(metric) is not None]
    if not values:
        return {}
    best_round, best = max(values, key=lambda rv: (rv[1], -rv[0]))
    tail = [v for _, v in values[-window:]]
    return {"best": best, "best_round": best_round, "best_rule": f"max of {metric} over evaluated rounds",
            "final": sum(tail) / len(tail), "final_rule": f"mean of {metric} over the last {len(tail)} evaluations",
            "last": values[-1][1]}


class Experiment:
    """One run of one config, in one run directory."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.algorithm = make_algorithm(cfg)
        self.federation = build_federation(cfg.data, cfg.seed)
        models, client_arch = build_models(cfg, self.federation)
        t = cfg.train
        self.precision = resolve_precision(cfg.run.precision, cfg.run.device)
        settings = TrainSettings(epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                                 weight_decay=t.weight_decay, drop_last=t.drop_last, clip_grad_norm=t.clip_grad_norm,
                                 precision=self.precision)
        try:
            self.sim = make_engine(self.algorithm, self.federation, models, client_arch, settings,
                                   t.clients_per_round, cfg.seed, engine=cfg.run.engine, workers=cfg.run.workers,
                                   device=cfg.run.device, threads=cfg.run.threads)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.metric = headline_metric(self.algorithm, self.federation)
        self.start_round = 0                        # rounds already done (set by resume)

    # --- run directory ----------------------------------------------------------------
    @classmethod
    def create(cls, cfg: ExperimentConfig, run_dir: str | Path | None = None) -> "Experiment":
        if run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(cfg.run.out_dir) / f"{cfg.name}-s{cfg.seed}-{stamp}"
        run_dir = Path(run_dir)
        if (run_dir / METRICS).exists():
            raise ConfigError(f"{run_dir} already holds a run; use `fedhet run --resume {run_dir}` or another --out")
        exp = cls(cfg, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        (run_dir / METRICS).touch()
        fed = exp.federation
        (run_dir / "partition.json").write_text(json.dumps({
            "train_counts": fed.train_counts().tolist(), "test_counts": fed.test_counts().tolist(),
            "local_test_source": fed.local_test_source}))
        return exp

    @classmethod
    def resume(cls, run_dir: str | Path) -> "Experiment":
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise CheckpointError(f"{run_dir} is not a fedhet run directory (no config.yaml)")
        exp = cls(load_config(run_dir / "config.yaml"), run_dir)
        ckpt = run_dir / CHECKPOINT
        if ckpt.exists():
            try:
                snap = torch.load(ckpt, weights_only=False)
                exp.sim.restore(snap["sim"])
                exp.start_round = int(snap["round"])
            except Exception as e:  # a truncated or foreign file: say so, keep the metrics
                raise CheckpointError(f"cannot read checkpoint {ckpt}: {e}. The recorded metrics in {run_dir / METRICS} "
                                      f"are intact; delete the checkpoint to restart the run from round 1.") from None
        exp._truncate_metrics(exp.start_round)
        return exp

    def _truncate_metrics(self, done_rounds: int) -> None:
        """Drop metric lines of rounds after the checkpoint: they will be recomputed identically."""
        path = self.run_dir / METRICS
        rows = self.read_metrics()
        with open(path, "w") as f:
            for row in rows:
                if row["round"] <= done_rounds:
                    f.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def _append_metrics(self, row: dict) -> None:
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _checkpoint(self, done_rounds: int) -> None:
        tmp = self.run_dir / (CHECKPOINT + ".tmp")
        torch.save({"round": done_rounds, "sim": self.sim.snapshot()}, tmp)
        os.replace(tmp, self.run_dir / CHECKPOINT)

    # --- the loop -------------------------------------------------------------------
    def run(self, progress: bool | None = None) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        start = self.start_round
        show = cfg.run.progress if progress is None else progress
        bar = tqdm(range(start, cfg.train.rounds), initial=start, total=cfg.train.rounds, disable=not show,
                   desc=cfg.name, unit="round", dynamic_ncols=True)
        t_run = time.perf_counter()
        status, error = "completed", None
        try:
            for rnd in bar:
                t0 = time.perf_counter()
                done = rnd + 1
                evaluating = done % cfg.eval.every == 0 or done == cfg.train.rounds
                stats = self.sim.run_round(rnd, evaluating)
                row = {"round": done, "clients": stats.clients, "phases": stats.phases,
                       "train_loss": stats.mean_train_loss(),
                       "samples": stats.samples, "comm": self.sim.ledger.take_round(rnd),
                       # persistent per-client memory (SCAFFOLD c_i, FedDyn state, MOON previous model, ...)
                       "client_state_floats": tensor_floats(self.sim.client_states)}
                t_eval = 0.0
                if evaluating:
                    t1 = time.perf_counter()
                    row.update(self.evaluate_round())
                    t_eval = time.perf_counter() - t1
                row.update(self.algorithm.round_metrics(self.sim.server_state))
                row["seconds"] = {"train": stats.train_seconds, "aggregate": stats.aggregate_seconds,
                                  "evaluate": t_eval, "total": time.perf_counter() - t0}
                self._append_metrics(row)
                if done % cfg.run.checkpoint_every == 0 or done == cfg.train.rounds:
                    self._checkpoint(done)
                if self.metric in row:
                    bar.set_postfix({self.metric: f"{row[self.metric]:.4f}"})
        except FedhetError as e:
            status, error = "failed", str(e)
            raise
        except KeyboardInterrupt:
            status, error = "interrupted", "interrupted by the user"
            raise
        except Exception as e:  # a bug or an unexpected failure: never recorded as "completed"
            status, error = "failed", f"{type(e).__name__}: {e}"
            raise
        finally:
            bar.close()
            if hasattr(self.sim, "close"):      # worker processes of the parallel engine
                self.sim.close()
            self.write_summary(status, error, time.perf_counter() - t_run)
        return self.summary

    def evaluate_round(self) -> dict:
        """This round's metrics (metrics/evaluate.py); the Flower engine overrides it to have the
        clients test their own models (fedhet/flower/engine.py)."""
        return evaluate(self.sim, self.cfg.eval.batch_size, self.cfg.eval.personalized)

    def write_summary(self, status: str, error: str | None, wall: float) -> None:
        rows = self.read_metrics()
        secs = [r["seconds"]["total"] for r in rows]
        train_secs = [r["seconds"]["train"] for r in rows]
        samples = sum(r["samples"] for r in rows)
        summary = {
            "name": self.cfg.name, "algorithm": self.algorithm.name, "seed": self.cfg.seed, "status": status,
            "error": error, "rounds_completed": rows[-1]["round"] if rows else 0, "rounds_planned": self.cfg.train.rounds,
            "headline_metric": self.metric,
            "headline": summarize_metrics(rows, self.metric, self.cfg.eval.final_window),
            "metrics": {m: summarize_metrics(rows, m, self.cfg.eval.final_window)
                        for m in ("global_acc", "global_labeldist_acc", "personal_acc", "personal_acc_pooled")
                        if any(m in r for r in rows)},
            "seconds_per_round_median": statistics.median(secs) if secs else None,
            "train_seconds_per_round_median": statistics.median(train_secs) if train_secs else None,
            "client_samples_per_second": samples / sum(train_secs) if train_secs and sum(train_secs) > 0 else None,
            "wall_seconds_this_session": wall,
            "peak_memory_mb": peak_memory_mb(),
            "communication": self.sim.ledger.totals(),
            "precision": self.precision,
            "bf16_native": bf16_native(self.cfg.run.device),
            "engine": engine_info(self.sim),
            "machine": machine_info(),
        }
        self.summary = summary
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if rows:
            from fedhet.experiment.plots import plot_run
            plot_run(rows, self.run_dir / "accuracy.png", title=f"{self.cfg.name} (seed {self.cfg.seed})")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut off by a kill: everything before it is intact
    return rows
