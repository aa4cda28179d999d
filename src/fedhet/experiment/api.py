"""fedhet from Python: ``fedhet.run(config)`` for notebooks and scripts.

    import fedhet
    res = fedhet.run("configs/quickstart.yaml", {"train.rounds": 5}, out="runs/try")
    print(res.summary["headline"])                 # best / final with the rules that chose them
    accs = res.metric("global_acc")                # [(round, value), ...]
    res.rows[-1]["comm"]                           # every metrics.jsonl record, as dicts
    more = fedhet.resume(res.run_dir, {"train.rounds": 10})   # extend it (or go on after a crash)
    old = fedhet.load("runs/try")                  # a run on disk, finished or not

The run is the same as ``fedhet run``: a run directory with config.yaml, metrics.jsonl,
summary.json, checkpoints and plots; ``metrics.jsonl`` stays the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhet.core.errors import ConfigError
from fedhet.experiment.config import ExperimentConfig, load_config
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.runner import Experiment


@dataclass(repr=False)
class Results:
    """What one run produced: the summary, the per-round records and where they are on disk."""

    run_dir: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]

    def metric(self, name: str) -> list[tuple[int, float]]:
        """``(round, value)`` of ``name`` over the rounds that recorded it; a KeyError naming the
        metrics the run recorded when no round recorded ``name``."""
        values = [(r["round"], r[name]) for r in self.rows if r.get(name) is not None]
        odd = next((v for _, v in values if not isinstance(v, (int, float))), None)    # a flag (bool) counts
        if name == "round" or odd is not None:
            what = "the round itself" if name == "round" else f"values of type {type(odd).__name__}"
            raise KeyError(f"{name!r} is not a metric of numbers by round (it holds {what}): read it from the "
                           f"rows, [row[{name!r}] for row in results.rows]")
        if not values:
            recorded = sorted({k for r in self.rows for k, v in r.items() if isinstance(v, (int, float))
                               and not isinstance(v, bool)} - {"round"})
            raise KeyError(f"no round of {self.run_dir} recorded {name!r}; it recorded: "
                           f"{', '.join(recorded) or 'nothing'}")
        return values

    def __repr__(self) -> str:
        # a notebook shows this: the run and its headline, not every row
        if not self.summary:              # fedhet.load of a run without one (killed, or going on)
            return f"Results({str(self.run_dir)!r}, no summary, {len(self.rows)} rounds recorded)"
        head = self.summary.get("headline") or {}
        final = f", final {head['final']:.4f}" if isinstance(head.get("final"), (int, float)) else ""
        return (f"Results({str(self.run_dir)!r}, {self.summary.get('algorithm')}, {self.summary.get('status')}, "
                f"{self.summary.get('rounds_completed')} rounds, {self.summary.get('headline_metric')}{final})")


def _plain(value: Any, where: str) -> Any:
    """``value`` as the plain Python a config holds (what YAML writes): NumPy scalars and arrays
    become numbers and lists, paths strings, tuples lists; anything else is a ConfigError."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):      # numpy scalars (np.float64 is a float too) and arrays
        return _plain(value.tolist(), where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"{where}: a {type(value).__name__} ({value!r:.60}) cannot be written to a config; give a "
                      "number, a string, a list or a mapping of those")


def _assignments(overrides: dict[str, Any] | list[str] | None, caller: str = "fedhet.run") -> list[str]:
    """``overrides`` as ``--set`` items (``["train.rounds=5"]``); errors name ``caller``."""
    assignments: list[str]
    if overrides is None:
        assignments = []
    elif isinstance(overrides, dict):
        # Values go through the same parser as `--set key=value` (YAML scalars, lists, mappings).
        import yaml

        for k in overrides:
            if not isinstance(k, str):
                raise ConfigError(f"overrides: key {k!r} is not a string; name settings as 'section.key', e.g. "
                                  "{'train.rounds': 5}")
            if "=" in k:
                raise ConfigError(f"overrides: key {k!r} holds '=': in a dict the key names the setting and the "
                                  "dict's value is its value, e.g. {'train.lr': 0.1}")
        plain = {k: _plain(v, f"overrides[{k!r}]") for k, v in overrides.items()}
        assignments = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                       for k, v in plain.items()]
    elif isinstance(overrides, (list, tuple)) and all(isinstance(a, str) for a in overrides):
        assignments = list(overrides)
    else:
        one = " (one string: wrap it in a list)" if isinstance(overrides, str) else ""
        raise ConfigError(f"{caller}: overrides must be a dict {{'train.rounds': 5}} or a list of 'key=value' "
                          f"strings, not {type(overrides).__name__}{one}")
    return assignments


def _as_config(config: str | Path | dict | ExperimentConfig, overrides: dict[str, Any] | list[str] | None
               ) -> ExperimentConfig:
    assignments = _assignments(overrides)
    if isinstance(config, ExperimentConfig):
        raw = config.model_dump(mode="json")
        return load_config(overrides=assignments, raw=raw) if assignments else config
    if isinstance(config, dict):
        return load_config(overrides=assignments, raw=_plain(config, "config"))
    if isinstance(config, (str, Path)):
        return load_config(config, assignments)
    raise ConfigError(f"fedhet.run: config must be a YAML path, a dict or an ExperimentConfig, "
                      f"not {type(config).__name__}")


def run(config: str | Path | dict | ExperimentConfig, overrides: dict[str, Any] | list[str] | None = None, *,
        out: str | Path | None = None, progress: bool | None = None) -> Results:
    """Run one experiment and return its :class:`Results`.

    ``config``: a YAML path, a dict shaped like the YAML, or an ``ExperimentConfig``;
    ``overrides``: ``{"train.rounds": 5}`` or ``["train.rounds=5"]`` (as ``--set``);
    ``out``: the run directory (default: ``run.out_dir/<name>-s<seed>-<time>``, new each call);
    ``progress``: a progress bar on stderr (default: the config's ``run.progress``, on unless set off)."""
    cfg = _as_config(config, overrides)
    exp = Experiment.create(cfg, out)
    summary = exp.run(progress=progress)
    return Results(exp.run_dir, summary, read_metrics(exp.run_dir))


def load(run_dir: str | Path) -> Results:
    """The :class:`Results` of a run already on disk (finished, failed, interrupted, or one going on
    elsewhere): its summary (empty where summary.json is missing or unreadable: a killed run, or one
    still going) and every round its metrics.jsonl holds."""
    import json

    from fedhet.experiment.rundir import SUMMARY, checked_run_dir

    path = checked_run_dir(run_dir, resume=True, option="fedhet.load")
    try:
        summary = json.loads((path / SUMMARY).read_text())
    except (OSError, ValueError):
        summary = {}
    return Results(path, summary if isinstance(summary, dict) else {}, read_metrics(path))


def resume(run_dir: str | Path, overrides: dict[str, Any] | list[str] | None = None, *,
           progress: bool | None = None) -> Results:
    """Continue an interrupted run from its last checkpoint (``fedhet run --resume``).
    ``overrides`` as ``fedhet run --resume --set`` takes them: how the run is carried out
    (``{"run.device": "cpu"}``), or a raised ``train.rounds``, which extends a finished run."""
    import warnings

    exp = Experiment.resume(run_dir, run_settings=_assignments(overrides, "fedhet.resume"), option="fedhet.resume")
    try:
        if not exp.start_round:               # as `fedhet run --resume` says it
            warnings.warn(f"{exp.run_dir} has no checkpoint: the run starts again from round 1", UserWarning,
                          stacklevel=2)
        if (note := exp.set_aside_note()) is not None:
            warnings.warn(note, UserWarning, stacklevel=2)
    except BaseException:                     # warnings made errors: the folder is left free
        exp.rundir.unlock()
        raise
    summary = exp.run(progress=progress)
    return Results(exp.run_dir, summary, read_metrics(exp.run_dir))
