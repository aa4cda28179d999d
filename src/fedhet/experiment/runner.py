"""The run loop: config -> built objects -> rounds -> run directory, with callbacks.

:class:`Experiment` owns one :class:`fedhet.engine.loop.RoundLoop` and one
:class:`fedhet.experiment.rundir.RunDir`. Each round it runs the loop, evaluates when due, and
builds one metrics row; :class:`Callback` objects see the row before it is written (to add to
it) and after (progress, logs), and the summary before it is written (to add to it) and after
(loggers upload it and close). Callbacks see the run as a :class:`RunView`; this module imports
them, never the other way. The Flower runner (:mod:`fedhet.flower.engine`) is this loop with
another transport, another evaluator and its own callbacks.
"""

from __future__ import annotations

import functools
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhet.core.contract import Arrays, Message
from fedhet.core.errors import CheckpointError, ConfigError, FedhetError, OutputError
from fedhet.engine import EngineChoice, RoundLoop, make_loop
from fedhet.engine.client_store import ClientStates
from fedhet.engine.ledger import tensor_floats
from fedhet.engine.parallel import WorkerError
from fedhet.experiment.build import (
    Built,
    build,
    client_state_store,
    configure_process,
    missing_names,
    whole_local_model,
)
from fedhet.experiment.callbacks import Callback, RunView
from fedhet.experiment.config import (
    ExperimentConfig,
    check_resume_settings,
    config_changes,
    dump_config,
    load_config,
    params_alike,
)
from fedhet.experiment.loggers import make_loggers
from fedhet.experiment.rundir import (
    CHECKPOINT,
    CONFIG,
    EVALUATED_AS_LAST,
    METRICS,
    PARTITION,
    SUMMARY,
    RunDir,
    checked_run_dir,
    first_damaged_line,
    read_metrics,
)
from fedhet.experiment.summary import (
    SUMMARIZED_METRICS,
    machine_info,
    model_selection,
    peak_memory_mb,
    speed,
    summarize_metrics,
)
from fedhet.metrics.evaluate import evaluate_loop, evaluation_clients
from fedhet.models import resolved_options
from fedhet.training.local import trains_in_channels_last
from fedhet.training.precision import bf16_native, strict_fp32

__all__ = ["CHECKPOINT", "METRICS", "Callback", "Experiment", "RunView", "read_metrics"]


class ProgressBar(Callback):
    def __init__(self, exp: RunView, show: bool):
        from tqdm import tqdm

        cfg = exp.cfg
        self.bar = tqdm(total=cfg.train.rounds, initial=exp.start_round, disable=not show, desc=cfg.name,
                        unit="round", dynamic_ncols=True)

    def on_row_written(self, exp: RunView, row: dict) -> None:
        self.bar.update(1)
        if exp.metric in row:
            self.bar.set_postfix({exp.metric: f"{row[exp.metric]:.4f}"})

    def close(self) -> None:
        self.bar.close()


def already_holds_a_run(run_dir: str | Path) -> str:
    return (f"{run_dir} already holds a run: continue it with `fedhet run --resume {run_dir}` (from Python: "
            f"fedhet.resume({str(run_dir)!r})), or choose another --out (out=...)")


# What fedhet records under its own names in a metrics row, in every round or only in evaluated ones
# (the evaluation's metrics, a Flower run's "flower"): a method's round_metrics may not use them.
FEDHET_ROW_KEYS = frozenset({"round", "clients", "phases", "train_loss", "samples", "comm", "client_state_floats",
                             "server_state_floats", "seconds", "flower"})
FEDHET_METRIC_PREFIXES = ("global_", "personal_", "local_", "feature_")


def is_fedhet_metric(key: str) -> bool:
    return key in FEDHET_ROW_KEYS or key.startswith(FEDHET_METRIC_PREFIXES)


def is_evaluation_key(key: str) -> bool:
    """A row's key that an evaluation writes (global_*, personal_*, local_*, feature_*)."""
    return key.startswith(FEDHET_METRIC_PREFIXES)


def recordable(value: Any, where: str) -> Any:
    """``value`` as a metrics row holds it (JSON): a tensor or NumPy value as Python numbers (a norm
    is naturally a 0-d tensor), dicts and lists walked; a ConfigError at ``where`` for anything else."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):     # as Python values, checked in turn
        return recordable(value.tolist() if not isinstance(value, np.generic) else value.item(), where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): recordable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [recordable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where} is of type {type(value).__name__}, which a metrics row cannot hold: return numbers, "
                      "strings, tensors or lists and dicts of them")


def checkpoint_refusal(run_dir: Path, snap: Any, rounds: int, keeps_client_state: bool | None = None) -> str | None:
    """Why the checkpoint ``snap`` of ``run_dir`` cannot go on as a run of ``rounds`` rounds on a
    transport that keeps the clients' states with them (``keeps_client_state``; None: not asked),
    or None: fewer rounds than done (a run is extended, not cut), or client states kept elsewhere
    than that transport keeps them (in the file: the simulator's engines; with the clients: a Flower
    deployment's SuperNodes; checkpoints from before the flag name their engine)."""
    if not isinstance(snap, dict):
        return None
    done = snap.get("round")
    if isinstance(done, int) and rounds < done:
        return (f"train.rounds {rounds} is below the {done} rounds {run_dir} has done: a resumed run can be "
                "extended, not cut (its rows of every round stay in metrics.jsonl)")
    elsewhere = snap.get("client_states_elsewhere", snap.get("engine") == "flower")
    if keeps_client_state is not None and elsewhere != keeps_client_state:
        how = f"fedhet flower run --resume {run_dir}" if elsewhere else f"fedhet run --resume {run_dir}"
        where = "with its clients (a Flower deployment's SuperNodes)" if elsewhere else "in the file"
        return f"{run_dir / CHECKPOINT} was written by a run whose client states are {where}: continue it with `{how}`"
    return None


def _changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``"key: old -> new"`` for every key whose value differs (``'<absent>'`` where one lacks it)."""
    return [f"{prefix}{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def built_differently(then: dict[str, Any], now: dict[str, Any], params: Any) -> str | None:
    """What differs between two :meth:`Experiment.built_from` records, in words; None if nothing.
    ``params``: the method's parameters now, against which the recorded ones are validated again
    (a set dumps in no fixed order, and a key the recorded ones lack takes its default)."""
    problems = []
    old_params = then.get("algorithm_params")
    if isinstance(old_params, dict):
        if not params_alike(type(params), old_params, params):
            changed = _changes(old_params, now.get("algorithm_params") or {})
            problems.append("the method's parameters resolve otherwise than then (" + "; ".join(changed)
                            + "): a default in the method's code changed (yours, or fedhet's in another version)")
    old_options, new_options = then.get("model_options"), now.get("model_options") or {}
    if isinstance(old_options, dict):
        changed = []
        for arch in sorted(set(old_options) | set(new_options)):
            old, new = old_options.get(arch, {}), new_options.get(arch, {})
            if arch in old_options:
                # an option the builder has gained since takes its default, which builds the model of
                # then (as a method's parameter added since does)
                new = {k: v for k, v in new.items() if k in old}
            changed += _changes(old, new, f"{arch} ")
        if changed:
            problems.append("the models' options resolve otherwise than then (" + "; ".join(changed)
                            + "): a default of a model builder changed (yours, or fedhet's in another version)")
    if then.get("data") not in (None, now.get("data")):
        problems.append("the images or labels loaded differ from those it trained on (the dataset's files, "
                        "a user's data function, or the decoder of its image files, Pillow, changed)")
    elif then.get("partition") not in (None, now.get("partition")):
        problems.append("the clients' data split differs from the one it trained on (a user's partition "
                        "function, or the code that splits, changed)")
    return "; ".join(problems) or None


class Experiment:
    """One run of one config, in one run directory."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path, *, built: Built | None = None,
                 loop: RoundLoop | None = None, callbacks: list[Callback] | None = None,
                 evaluator: Callable[[Experiment, int], dict] | None = None,
                 checkpointer: Callable[[Experiment, int], None] | None = None):
        """``evaluator(exp, round)`` -> the round's metrics (default :meth:`evaluate_round`);
        ``checkpointer(exp, done_rounds)`` saves what a resume needs (default :meth:`checkpoint`).
        The Flower runner passes its own of both."""
        self.cfg = cfg
        configure_process(cfg)
        self.built = built or build(cfg)
        self.algorithm = self.built.algorithm
        self.federation = self.built.federation
        self.precision = self.built.precision
        # eval.precision "run": the evaluation passes in the run's resolved precision, on the
        # run's device (where the clients train).
        self.eval_precision = self.precision if cfg.eval.precision == "run" else "fp32"
        if self.precision == "bf16" and not bf16_native(self.built.device):
            warnings.warn(f"run.precision: bf16 trains on {self.built.device}, which has no native bf16 (emulated: "
                          "often slower than fp32, bf16_native: false in summary.json); run.precision: auto takes "
                          "bf16 only where it is native", stacklevel=2)
        if self.eval_precision == "bf16" and self.built.device == "cpu" and not bf16_native("cpu"):
            warnings.warn("eval.precision: run evaluates this bf16 run in bf16 on a CPU without native bf16 "
                          "(emulated: several times slower than fp32); set eval.precision: fp32 to evaluate in fp32",
                          stacklevel=2)
        self.settings_not_applied = self.algorithm.settings_not_applied(self.built.host.settings)
        if self.settings_not_applied:
            warnings.warn(f"{self.algorithm.name} does not apply "
                          + "; ".join(f"{key} ({why})" for key, why in self.settings_not_applied.items())
                          + " (recorded in summary.json as settings_not_applied)", stacklevel=2)
        self.metric = self.built.metric
        self.engine_choice: EngineChoice | None = None
        if loop is None:
            try:
                loop, self.engine_choice = make_loop(self.built.host, cfg.train.clients_per_round,
                                                     engine=cfg.run.engine, workers=cfg.run.workers,
                                                     device=self.built.device, threads=cfg.run.threads,
                                                     cuda_graphs=cfg.run.cuda_graphs, keep_graphs=cfg.run.keep_graphs,
                                                     client_states=client_state_store(cfg.run, Path(run_dir)))
            except ValueError as e:     # e.g. a method's init_server_state refusing the model; chained, so a
                raise ConfigError(f"algorithm {cfg.algorithm.name}: {e}") from e   # method of one's own keeps its line
        self.loop = loop
        self.rundir = RunDir(run_dir)
        self.callbacks: list[Callback] = list(callbacks or [])
        self.evaluator = evaluator or Experiment.evaluate_round
        self.checkpointer = checkpointer or Experiment.checkpoint
        self.start_round = 0                        # rounds already done (set by resume)
        self.rounds_recorded = 0                    # rounds in metrics.jsonl
        self.checkpointed_round = 0                 # the round of the last checkpoint (0: none)
        self.stop_requested: str | None = None      # why the run stops after its round (request_stop)
        self.round_running: int | None = None       # the round now training or evaluating (1-based)
        self.restored: dict | None = None           # the checkpoint a resume continues from
        # an extended run's old last round, whose evaluation its row keeps under EVALUATED_AS_LAST
        self.evaluation_set_aside: int | None = None
        self._eval_clients: tuple[int, list[int]] | None = None     # (round, its eval_clients)
        self._built_from: dict[str, Any] | None = None
        self.summary: dict = {}
        # The "model" each client uploaded in the round just run, kept when eval.local_risk
        # evaluates it (FedACD Table 3's risk of local models); not checkpointed.
        self.local_models: dict[int, Arrays] = {}

    @property
    def run_dir(self) -> Path:
        return self.rundir.path

    # --- run directory ------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: ExperimentConfig, run_dir: str | Path | None = None, **kwargs: Any) -> Experiment:
        if run_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = base = Path(cfg.run.out_dir) / f"{cfg.name}-s{cfg.seed}-{stamp}"
            n = 1
            while run_dir.exists():         # two runs started within one second
                n += 1
                run_dir = base.with_name(f"{base.name}-{n}")
        else:
            run_dir = checked_run_dir(run_dir)
        rundir = RunDir(run_dir)
        if rundir.holds_run():
            raise ConfigError(already_holds_a_run(run_dir))
        exp = cls(cfg, run_dir, **kwargs)
        rundir = exp.rundir
        rundir.lock()
        try:
            if rundir.holds_run():          # another process created it while this one was building
                raise ConfigError(already_holds_a_run(run_dir))
            exp.write_run_files()
        except BaseException:
            rundir.unlock()
            raise
        return exp

    def write_run_files(self) -> None:
        """config.yaml, an empty metrics.jsonl and partition.json of a new run."""
        rundir, cfg = self.rundir, self.cfg
        rundir.write_text(CONFIG, dump_config(cfg))
        (rundir.path / METRICS).touch()
        self.write_partition()

    def write_partition(self) -> None:
        """partition.json: the clients' label counts, by which runs of one seed are paired."""
        fed = self.federation
        self.rundir.write_text(PARTITION, json.dumps({
            "train_counts": fed.train_counts().tolist(), "test_counts": fed.test_counts().tolist(),
            "local_test_source": fed.local_test_source}))

    def set_aside_note(self) -> str | None:
        """What a resume that extended the run did with its old last round's evaluation, for the
        user (``fedhet run --resume`` and a Flower server print it); None when it set none aside."""
        if self.evaluation_set_aside is None:
            return None
        return (f"round {self.evaluation_set_aside} was evaluated as the last round; a run of "
                f"{self.cfg.train.rounds} rounds evaluates every {self.cfg.eval.every} (and the last), so its "
                f"metrics stay in its row under {EVALUATED_AS_LAST!r}, outside the summary")

    @classmethod
    def resume(cls, run_dir: str | Path, *, threads: int | None = None, config: ExperimentConfig | None = None,
               run_settings: list[str] | None = None, option: str = "--resume", **kwargs: Any) -> Experiment:
        """Continue the run in ``run_dir`` from its checkpoint; ``threads`` replaces its
        ``run.threads`` (speed only: float sums may differ in the last bits). ``run_settings``
        (``KEY=VALUE``, only :data:`RESUMABLE_CHANGES` keys: how the run is carried out, e.g.
        ``run.device=cpu`` for a run stopped on a GPU; and ``train.rounds``, raised) replace the
        recorded values, and config.yaml records them from then on; a run whose precision would
        resolve otherwise on the new device (``run.precision: auto``) is refused. The Flower runner
        passes the ``config`` its run config holds (checked against config.yaml and the
        checkpoint like a changed file, and recorded in config.yaml where it differs in those
        keys) and its loop, callbacks... as ``kwargs``; the checkpoint read is kept as ``restored``.
        ``option``: what the errors call the run directory (``fedhet.resume`` from Python)."""
        rundir = RunDir(checked_run_dir(run_dir, resume=True, option=option))
        # --set on resume: how the run is carried out, and more rounds (the checkpoint check below refuses fewer)
        check_resume_settings(run_settings)
        cfg = load_config(rundir.path / CONFIG, run_settings)
        snap = rundir.load_checkpoint()
        if problem := checkpoint_refusal(rundir.path, snap, (config or cfg).train.rounds):
            raise CheckpointError(problem)
        recorded = cfg                      # what config.yaml records from here on (--threads aside)
        record = bool(run_settings)
        if config is not None:
            changed = config_changes(cfg.model_dump(mode="json"), config)
            if changed:
                raise CheckpointError(f"the config given to resume {run_dir} differs from its {CONFIG}: "
                                      + "; ".join(changed) + ". Resume with the run's own config")
            record = record or config.model_dump(mode="json") != cfg.model_dump(mode="json")
            cfg = recorded = config
        if threads:
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"threads": threads})})
        if snap is not None and isinstance(snap, dict) and isinstance(snap.get("config"), dict):
            changed = config_changes(snap["config"], cfg)
            if changed:
                raise CheckpointError(
                    f"{rundir.path / CONFIG} changed since the checkpoint of round {snap.get('round')}: "
                    + "; ".join(changed) + ". A resumed run must compute what it started computing: restore "
                    "those values, or start a new run (only raising train.rounds and run.* settings other than "
                    "run.precision may change)")
        exp = cls(cfg, run_dir, **kwargs)
        exp.rundir.lock()
        try:
            # run.precision "auto" resolves by device: a run moved to another device must not go on
            # in another precision (checkpoints from before this record have no "precision")
            trained_in = snap.get("precision") if isinstance(snap, dict) else None
            if trained_in is not None and trained_in != exp.built.precision:
                raise CheckpointError(
                    f"{run_dir} trained in {trained_in} and would go on in {exp.built.precision} here "
                    f"(run.precision: {cfg.run.precision}, run.device: {cfg.run.device}): resume it where it "
                    f"resolves to {trained_in}, or start a new run")
            if problem := checkpoint_refusal(rundir.path, snap, cfg.train.rounds, exp.loop.transport.keeps_client_state):
                raise CheckpointError(problem)
            if snap is not None and isinstance(snap, dict) and isinstance(snap.get("built_from"), dict):
                if problem := built_differently(snap["built_from"], exp.built_from(), exp.algorithm.params):
                    raise CheckpointError(f"{run_dir} cannot go on from its checkpoint of round {snap.get('round')}: "
                                          f"{problem}. A resumed run must compute what it started computing: "
                                          "restore them, or start a new run")
            if snap is not None:
                try:
                    exp.loop.restore(snap["sim"])
                    exp.start_round = int(snap["round"])
                    exp.restored = snap
                except (KeyError, TypeError, ValueError) as e:
                    raise CheckpointError(f"checkpoint {rundir.path / CHECKPOINT} does not hold a fedhet run's state "
                                          f"({type(e).__name__}: {e}); delete it to restart the run from round 1") from None
            recorded_rounds = {row.get("round") for row in rundir.read_metrics()}
            lost = [r for r in range(1, exp.start_round + 1) if r not in recorded_rounds]
            if lost:
                span = f"{lost[0]}" if len(lost) == 1 else f"{lost[0]}-{lost[-1]}" if lost == list(
                    range(lost[0], lost[-1] + 1)) else ", ".join(map(str, lost))
                damaged = first_damaged_line(rundir.path)
                where = f" (its line {damaged} is damaged or out of place)" if damaged else ""
                raise CheckpointError(f"{rundir.path / METRICS} lacks round(s) {span}{where}, which the checkpoint "
                                      f"of round {exp.start_round} has done: resumed, the run would end 'completed' "
                                      f"without them. Restore {METRICS} from a copy (or mend that line), or start "
                                      "the run anew in another folder")
            planned = snap.get("config", {}).get("train", {}).get("rounds") if isinstance(snap, dict) else None
            if planned == exp.start_round < cfg.train.rounds:            # a finished run, extended
                problem = exp.algorithm.extension_problem(exp.start_round, cfg.train.rounds)
                if problem:
                    raise CheckpointError(f"{run_dir} cannot be extended to {cfg.train.rounds} rounds: {problem}")
            rundir.truncate_metrics(exp.start_round)
            if exp.start_round < cfg.train.rounds and exp.start_round % cfg.eval.every:
                # extended: the old last round was evaluated only as the last; a run of the new
                # length evaluates no such round, and its summary must not count one
                if rundir.set_aside_evaluation(exp.start_round, is_evaluation_key):
                    exp.evaluation_set_aside = exp.start_round
            if record:
                rundir.write_text(CONFIG, dump_config(recorded))
            if not (rundir.path / PARTITION).is_file():     # lost (a partial copy): the same split, written again
                exp.write_partition()
        except BaseException:
            exp.rundir.unlock()        # a refused resume leaves the folder free
            raise
        return exp

    def read_metrics(self) -> list[dict]:
        return self.rundir.read_metrics()

    def checkpoint(self, done_rounds: int, **extra: Any) -> None:
        """``extra``: what else a resume needs (the Flower runner's node commits)."""
        self.rundir.save_checkpoint({"round": done_rounds, "sim": self.loop.snapshot(),
                                      "config": self.cfg.model_dump(mode="json"), "precision": self.built.precision,
                                      "client_states_elsewhere": self.loop.transport.keeps_client_state,
                                      "built_from": self.built_from(), **extra})
        self.loop.snapshot_saved()

    def built_from(self) -> dict[str, Any]:
        """What the config alone does not fix and a resume must find unchanged: the method's
        parameters and each model's options with every default filled in (a user's code, or
        another fedhet version, may change a default) and the
        federation's :meth:`~fedhet.data.federated.Federation.fingerprint` (dataset files, a user's
        data or partition function). Computed once per run."""
        if self._built_from is None:
            self._built_from = {"algorithm_params": self.algorithm.params.model_dump(mode="json"),
                                "model_options": {arch: resolved_options(arch, self.cfg.model.options_of(arch))
                                                  for arch in dict.fromkeys(self.cfg.model.archs())},
                                **self.federation.fingerprint()}
        return self._built_from

    # --- the loop -----------------------------------------------------------------------
    def run(self, progress: bool | None = None) -> dict:
        cfg = self.cfg
        self.rounds_recorded = self.checkpointed_round = self.start_round
        show = cfg.run.progress if progress is None else progress
        bar = ProgressBar(self, show)
        callbacks = [*self.callbacks, bar, *make_loggers(self)]
        t_run = time.perf_counter()
        status, error = "completed", None
        try:
            with strict_fp32(torch.device(self.built.device)):   # fp32 means fp32 on CUDA too: TF32 off
                self.run_rounds(callbacks)
        except FedhetError as e:
            status, error = "failed", str(e)
            e.add_note(self._where_note())
            raise
        except KeyboardInterrupt as e:
            status, error = "interrupted", str(e) or "interrupted by the user"
            e.add_note(self._where_note())
            raise
        except Exception as e:  # a bug or an unexpected failure: never recorded as "completed"
            if self.stop_requested and isinstance(e, WorkerError):
                # the stop reached the workers too (killed with the run's process group): no failure
                status = "interrupted"
                error = f"{self.stop_requested}; round {self.rounds_recorded + 1} could not end: {e}"
                raise KeyboardInterrupt(error) from e
            status, error = "failed", f"{type(e).__name__}: {e}"
            e.add_note(self._where_note())
            raise
        finally:
            try:
                # each step apart: a failure of one (said beside the run's own error) leaves the others to run
                for step, what in ((bar.close, "closing the progress bar"),
                                   (self.loop.close, "closing the engine"),      # worker processes, device copies
                                   (lambda: self.write_summary(status, error, time.perf_counter() - t_run, callbacks),
                                    "recording the summary")):
                    try:
                        step()
                    except Exception as e:
                        if status == "completed":
                            raise
                        warnings.warn(f"{self.run_dir}: {what} of the {status} run failed too: "
                                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            finally:
                self.rundir.unlock()        # whatever failed above: the folder is free to resume
        return self.summary

    def request_stop(self, why: str) -> None:
        """Stop after the round now running: it is recorded and checkpointed, then the run ends
        "interrupted" (KeyboardInterrupt), to go on from there with a resume. ``fedhet run`` asks
        for it at the first Ctrl-C or SIGTERM."""
        self.stop_requested = why

    def stop_note(self, resume: str = "fedhet run --resume") -> str:
        """Where an interrupted run stands and how ``resume RUN_DIR`` goes on: from its checkpoint."""
        done, kept, total = self.rounds_recorded, self.checkpointed_round, self.cfg.train.rounds
        go_on = f"{resume} {self.run_dir}"
        if done >= total:
            return f"stopped while the summary of its {total} rounds was written: {go_on} writes it again"
        where = (f"stopped after round {done} of {total}" if self.stop_requested and done == kept and done
                 else f"stopped during round {done + 1} of {total}")
        if not kept:
            return f"{where}; no checkpoint yet: {go_on} starts it again from round 1"
        rerun = f"round {done} runs" if done == kept + 1 else f"rounds {kept + 1}-{done} run"
        again = (f" ({rerun} again: a checkpoint every {self.cfg.run.checkpoint_every} rounds, "
                 "run.checkpoint_every)" if done > kept else "")
        return f"{where}; its checkpoint of round {kept} keeps the run: {go_on} goes on from round {kept + 1}{again}"

    def _stop_if_asked(self) -> None:
        """Before a round: stop here if asked to, the rounds recorded checkpointed first (a stop asked
        for in the last round lets the run complete)."""
        if not self.stop_requested:
            return
        done = self.rounds_recorded
        if done > self.checkpointed_round:
            self.checkpointer(self, done)
            self.checkpointed_round = done
        raise KeyboardInterrupt(f"stopped after round {done}: {self.stop_requested}" if done
                                else f"stopped before round 1: {self.stop_requested}")

    def _where_note(self) -> str:
        # a run started from Python with the default, time-stamped folder: where its rounds are
        go_on = (f"fedhet flower run --resume {self.run_dir}, or on a deployment fedhet flower app --resume"
                 if self.loop.transport.keeps_client_state else "fedhet.resume")
        kept = self.checkpointed_round
        resume = (f"{go_on} goes on from its checkpoint of round {kept}" if kept else
                  f"it has no checkpoint yet (one every run.checkpoint_every = {self.cfg.run.checkpoint_every} "
                  f"rounds), so {go_on} would start it again from round 1")
        return f"run directory: {self.run_dir} (fedhet.load reads what it recorded; {resume})"

    def run_rounds(self, callbacks: list[Callback]) -> None:
        """The rounds still to run: train, evaluate when due, record, checkpoint."""
        cfg = self.cfg
        for rnd in range(self.start_round, cfg.train.rounds):
            self._stop_if_asked()
            self.round_running = done = rnd + 1
            t0 = time.perf_counter()
            evaluating = done % cfg.eval.every == 0 or done == cfg.train.rounds
            self.local_models = {}
            # checked every round (a partial upload stops the run at round 1), kept when evaluated
            keep = functools.partial(self.keep_local_model, evaluating=evaluating) if cfg.eval.local_risk else None
            # an adaptation before the evaluation (FedBABU's fine-tuning, Per-FedAvg's step) serves these only
            tested = (self.eval_clients(rnd) if cfg.eval.personalized else []) if evaluating else None
            stats = self.loop.run_round(rnd, evaluating, cfg.train.rounds, keep, tested)
            row = {"round": done, "clients": stats.clients, "phases": stats.phases,
                   "train_loss": stats.mean_train_loss(),
                   "samples": stats.samples, "comm": self.loop.ledger.take_round(rnd),
                   # persistent per-client memory (SCAFFOLD c_i, FedDyn state, MOON previous model, ...)
                   "client_state_floats": tensor_floats(self.loop.client_states),
                   # the server's, per-client parts included (FedReMa's and FedPAC's heads, KT-pFL's matrix)
                   "server_state_floats": tensor_floats(self.loop.server_state)}
            t_eval = 0.0
            if evaluating:
                t1 = time.perf_counter()
                row.update(self.evaluator(self, rnd))
                t_eval = time.perf_counter() - t1
            own = self.algorithm.round_metrics(self.loop.server_state)
            if clash := sorted(k for k in own if k in row or is_fedhet_metric(k)):   # not passed off as fedhet's
                raise ConfigError(f"algorithm {self.algorithm.name}: round_metrics returns {', '.join(clash)}, "
                                  f"a name of fedhet's own metrics (the row's fixed keys and global_*, personal_*, "
                                  f"local_*, feature_*); name the method's values apart, e.g. "
                                  f"{self.algorithm.name}_{clash[0]}")
            row.update({k: recordable(v, f"algorithm {self.algorithm.name}: round_metrics()[{k!r}]")
                        for k, v in own.items()})
            row["seconds"] = {"train": stats.train_seconds, "aggregate": stats.aggregate_seconds,
                              "evaluate": t_eval, "total": time.perf_counter() - t0}
            for cb in callbacks:
                cb.on_row(self, row)
            self.rundir.append_metrics(row)
            self.rounds_recorded = done
            for cb in callbacks:
                cb.on_row_written(self, row)
            if done % cfg.run.checkpoint_every == 0 or done == cfg.train.rounds:
                self.checkpointer(self, done)
                self.checkpointed_round = done
            self.round_running = None

    def keep_local_model(self, cid: int, reply: Message, evaluating: bool = True) -> None:
        """Under ``eval.local_risk``, every round: check that ``cid``'s upload stands for its whole
        model (``local_model``), and keep that model when the round is evaluated."""
        if "model" not in reply.arrays:
            return
        host = self.loop.host
        model, missing = whole_local_model(self.algorithm, reply.arrays["model"], host.init_models[host.client_arch[cid]])
        if missing:                            # a client_update of one's own (build checks uploaded_model)
            raise ConfigError(f"eval.local_risk: {self.algorithm.name}'s client {cid} uploaded only part of its model "
                              f"({missing_names(missing)} missing), so its risk would be measured with the initial "
                              "weights in their place; set eval.local_risk: false for this method")
        if evaluating:
            self.local_models[cid] = model

    def evaluate_round(self, rnd: int) -> dict:
        """This round's metrics (metrics/evaluate.py, and metrics/features.py when due)."""
        out = evaluate_loop(self.loop, self.cfg.eval.batch_size, self.cfg.eval.personalized, self.local_models,
                            self.eval_clients(rnd), self.eval_precision)
        every = self.cfg.eval.features_every
        weights = self.algorithm.global_model(self.loop.server_state) if every and (rnd + 1) % every == 0 else None
        if weights is not None:
            from fedhet.metrics.features import feature_quality, global_test_features

            host = self.loop.host
            feats, labels = global_test_features(host.client_models[host.client_arch[0]], weights, host.federation,
                                                 self.cfg.eval.features_samples, device=host.device)
            out.update(feature_quality(feats, labels, host.federation.num_classes))
        return out

    def eval_clients(self, rnd: int) -> list[int]:
        """The clients whose local splits round ``rnd`` evaluates (``eval.clients``); drawn once per
        round (the adaptation before an evaluation and the evaluation both ask)."""
        if self._eval_clients is None or self._eval_clients[0] != rnd:
            self._eval_clients = (rnd, evaluation_clients(self.cfg.eval.clients, self.federation.num_clients,
                                                          self.loop.sample_clients(rnd), self.cfg.seed))
        return list(self._eval_clients[1])

    def engine_info(self) -> dict:
        info = self.loop.transport.info()
        if self.engine_choice is not None and self.engine_choice.engine == info.get("engine"):
            info["reason"] = self.engine_choice.reason
        return info

    def write_summary(self, status: str, error: str | None, wall: float,
                      callbacks: list[Callback] | None = None) -> None:
        rows = self.read_metrics()
        window = self.cfg.eval.final_window
        # the layout local training's convolutions ran in, and how many calls ran in the other one
        layout, apart = self.loop.transport.training_layout(trains_in_channels_last(self.built.host.settings))
        summary = {
            "name": self.cfg.name, "algorithm": self.algorithm.name,
            "algorithm_params": self.algorithm.params.model_dump(mode="json"),     # every default filled in
            "seed": self.cfg.seed, "status": status,
            "error": error, "rounds_completed": rows[-1]["round"] if rows else 0,
            "rounds_planned": self.cfg.train.rounds,
            "headline_metric": self.metric,
            "headline": summarize_metrics(rows, self.metric, window),
            "metrics": {m: summarize_metrics(rows, m, window) for m in SUMMARIZED_METRICS
                        if any(m in r for r in rows)},
            "model_selection": model_selection(rows),
            **speed(rows),
            "wall_seconds_this_session": wall,
            "peak_memory_mb": peak_memory_mb(),
            "communication": self.loop.ledger.totals(),
            "precision": self.precision,
            "eval_precision": self.eval_precision,
            "device": self.built.device,
            "bf16_native": bf16_native(self.built.device),
            "memory_format": layout,
            **({"settings_not_applied": self.settings_not_applied} if self.settings_not_applied else {}),
            **({"channels_last_requests": apart} if apart else {}),   # vectorized requests trained apart
            "engine": self.engine_info(),
            # None where the clients' hosts keep their states (Flower's nodes), not this process's store
            "client_states": (states.info() if isinstance(states := self.loop.client_states, ClientStates)
                              and not self.loop.transport.keeps_client_state else None),
            "machine": machine_info(),
        }
        callbacks = callbacks if callbacks is not None else self.callbacks
        for cb in callbacks:
            cb.on_summary(self, summary)
        self.summary = summary
        self.rundir.write_json(SUMMARY, summary)
        if rows:
            from fedhet.experiment.plots import plot_run
            try:
                plot_run(rows, self.run_dir / "accuracy.png", title=f"{self.cfg.name} (seed {self.cfg.seed})")
            except OutputError as e:         # a picture of what summary.json and metrics.jsonl hold
                warnings.warn(f"{e}; the run's summary.json and metrics.jsonl are written", RuntimeWarning,
                              stacklevel=2)
        for cb in callbacks:
            cb.on_finished(self, summary)
