"""Reading run directories as seeds of experiments: a run's summary and its paper's number, checked,
and runs grouped by config name (each group's runs being seeds of one experiment)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import yaml

from fedhet.core.errors import CheckpointError
from fedhet.experiment.config import RUN_VALUE_PATTERN, ExperimentConfig, flatten_config
from fedhet.experiment.rundir import CONFIG, SUMMARY, RunDir, read_metrics
from fedhet.experiment.yaml_io import parse_yaml


def load_summary(run_dir: Path) -> dict:
    """The summary.json of ``run_dir``, or a CheckpointError naming what is wrong: the folder is
    missing or a file, it has no summary, or the summary is not JSON with a name and metrics
    (``fedhet compare`` checks the other fields it reads: :func:`_summary_problems`)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise CheckpointError(f"{run_dir} does not exist: name a run directory (one holding summary.json)")
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is a file, not a run directory: name the folder that holds its "
                              "summary.json")
    path = run_dir / "summary.json"
    if not path.is_file():
        runs = sorted(d.name for d in run_dir.iterdir() if (d / "summary.json").is_file())
        if runs:
            raise CheckpointError(f"{run_dir} is a folder of runs ({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}), "
                                  f"not a run: name its runs, e.g. {run_dir}/*, or print a sweep's table with "
                                  "`fedhet sweep SWEEP_FILE --table`")
        raise CheckpointError(f"{run_dir} has no summary.json (not a fedhet run directory, or the run never started)")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is damaged ({e}), so {run_dir} cannot be compared: leave it out, or run "
                              f"`fedhet run --resume {run_dir}` to write its summary again") from None
    if not isinstance(summary, dict) or "name" not in summary or "metrics" not in summary:
        raise CheckpointError(f"{path} is not a fedhet run summary (no name or metrics): leave {run_dir} out")
    return summary


def _is_number(value: object) -> bool:
    """A finite number (a summary's NaN, written by hand, would end the table in a statistics error)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _summary_problems(summary: dict) -> list[str]:
    """What is wrong with the fields of a summary that compare reads (empty when nothing is)."""
    expected = {"name": (str, "a string"), "algorithm": (str, "a string"), "seed": (int, "a whole number"),
                "headline_metric": (str, "a string"), "rounds_completed": (int, "a whole number"),
                "metrics": (dict, "a mapping")}
    problems = [f"{key} is {summary[key]!r}, not {what}" if key in summary else f"it has no {key}"
                for key, (kind, what) in expected.items()
                if key not in summary or not isinstance(summary[key], kind) or isinstance(summary[key], bool)]
    for metric, stats in summary.get("metrics", {}).items() if isinstance(summary.get("metrics"), dict) else ():
        if stats and not (isinstance(stats, dict) and _is_number(stats.get("final")) and _is_number(stats.get("best"))):
            problems.append(f"metrics.{metric} has no numeric final and best")
    return problems


# Keys two runs may differ in and still be seeds of one experiment: the seed itself, how the run
# was carried out (engine, device, threads, ...), its name and the paper's note.
_SEED_FREE = ("seed", "name")


def _experiment_keys(run_dir: Path) -> dict | None:
    """A run's recorded config, flattened, without the keys seeds of one experiment may differ in;
    None when the folder has no readable config.yaml."""
    recorded = _recorded_config(run_dir)
    if recorded is None:
        return None
    flat = flatten_config(recorded)
    return {k: v for k, v in flat.items() if k not in _SEED_FREE and not k.startswith(("run.", "paper"))}


def _check_same_experiment(name: str, runs: list[tuple[Path, dict]]) -> None:
    """Runs pooled as seeds of ``name`` must differ in nothing but the seed and how they were run."""
    configs = [(d, _experiment_keys(d)) for d, _ in runs]
    missing = [str(d) for d, c in configs if c is None]
    if missing:
        raise CheckpointError(f"runs named {name!r}: {', '.join(missing)} has no readable config.yaml, so it cannot "
                              "be told whether it is the same experiment as the others; compare it alone")
    # config.yaml holds a method's parameters as the config gave them; the summary (of runs since it
    # records them) with every default filled in, so `server_lr: 0.5` given and left at its default 0.5 agree
    resolved = [summary.get("algorithm_params") for _, summary in runs]
    if all(isinstance(params, dict) for params in resolved):
        common = set.intersection(*(set(params) for params in resolved))
        partly = set.union(*(set(params) for params in resolved)) - common
        for (_, keys), params in zip(configs, resolved):
            assert keys is not None
            given = keys.get("algorithm.params") or {}
            # a parameter only some runs recorded (their method gained it later): as their configs gave it
            keys["algorithm.params"] = {**{k: given.get(k, "<default>") for k in sorted(partly)},
                                        **{k: params[k] for k in sorted(common)}}
    # a key one run's config lacks (recorded before the key existed) reads as its default
    defaults = flatten_config(ExperimentConfig().model_dump(mode="json"))
    first_dir, first = configs[0]
    for d, other in configs[1:]:
        assert first is not None and other is not None
        keys = sorted(set(first) | set(other))
        a = {k: first.get(k, defaults.get(k, "<absent>")) for k in keys}
        b = {k: other.get(k, defaults.get(k, "<absent>")) for k in keys}
        diffs = [f"{k}: {a[k]!r} in {first_dir}, {b[k]!r} in {d}" for k in keys if a[k] != b[k]]
        if diffs:
            raise CheckpointError(f"runs named {name!r} differ in more than the seed, so they are not seeds of one "
                                  f"experiment ({'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}); give "
                                  "each config its own name, or compare them separately")


def _recorded_config(run_dir: Path) -> dict | None:
    """A run's config.yaml as a mapping; None when it is missing, unreadable or not a mapping."""
    try:
        recorded = parse_yaml((Path(run_dir) / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return recorded if isinstance(recorded, dict) else None


def load_paper(run_dir: Path) -> dict | None:
    """The ``paper`` section of a run's recorded config (what the paper reports), or None when the
    config has none (or the folder has no config.yaml). A config.yaml that cannot be read, or whose
    paper section is not one, is a CheckpointError: its paper column would silently go missing."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        return None
    recorded = _recorded_config(run_dir)
    if recorded is None:
        raise CheckpointError(f"{path} is damaged (not readable as a fedhet config), so the paper's number for "
                              f"{run_dir} cannot be read: restore the file, or leave {run_dir} out")
    paper = recorded.get("paper")
    if paper is not None and not (isinstance(paper, dict) and _is_number(paper.get("value"))
                                  and (paper.get("std") is None or _is_number(paper["std"]))):
        raise CheckpointError(f"{path}: its paper section ({paper!r:.80}) is not a paper result (a mapping with a "
                              f"numeric value): restore the file, or leave {run_dir} out")
    how = (paper or {}).get("measured_as", "final")
    if not (isinstance(how, str) and re.fullmatch(RUN_VALUE_PATTERN, how)):
        raise CheckpointError(f"{path}: its paper.measured_as {how!r} is not final, best, lowest:METRIC or "
                              f"highest:METRIC: correct it (e.g. highest:global_val_acc), or leave {run_dir} out")
    return paper


def group_runs(run_dirs: list[Path]) -> tuple[dict[str, list[tuple[Path, dict]]], list[str]]:
    """Runs grouped by config name, each group's runs being seeds of one experiment; and the
    failed runs left out (their numbers stop where they failed). Two runs of one name must be the
    same algorithm with different seeds, and no folder may be given twice."""
    groups: dict[str, list[tuple[Path, dict]]] = defaultdict(list)
    seen: dict[Path, Path] = {}
    left_out: list[str] = []
    for d in map(Path, run_dirs):
        real = d.resolve()
        if real in seen:
            raise CheckpointError(f"{d} is given twice (also as {seen[real]}): one run would count as two seeds")
        seen[real] = d
        if d.is_dir() and not (d / SUMMARY).is_file() and RunDir(d).holds_run():
            # a run going on (a sweep's), or one killed before its summary: its rows so far are no result
            rows, holder = len(read_metrics(d)), RunDir(d).held_by()
            left_out.append(f"{d} (no summary yet: {rows} round(s) recorded; " + (
                f"going on, pid {holder})" if holder else
                f"stopped before its summary: fedhet run --resume {d}, or fedhet flower run --resume for a Flower run)"))
            continue
        s = load_summary(d)
        problems = _summary_problems(s)
        if problems:
            raise CheckpointError(f"{d / 'summary.json'} is damaged ({'; '.join(problems)}), so {d} cannot be "
                                  f"compared: leave it out, or run `fedhet run --resume {d}` to write its summary "
                                  "again")
        if s.get("status") == "failed":
            left_out.append(f"{d} (failed: {s.get('error') or 'no reason recorded'})")
            continue
        groups[s["name"]].append((d, s))
    for name, runs in groups.items():
        algorithms = {s["algorithm"] for _, s in runs}
        if len(algorithms) > 1:
            listing = ", ".join(f"{d} ({s['algorithm']})" for d, s in runs)
            raise CheckpointError(f"runs named {name!r} ran different algorithms ({listing}), so they are not seeds "
                                  "of one experiment: give each config its own name, or compare them separately")
        if len(runs) > 1:
            _check_same_experiment(name, runs)
        by_seed: dict[int, Path] = {}
        for d, s in runs:
            seed = int(s["seed"])
            if seed in by_seed:
                raise CheckpointError(f"{by_seed[seed]} and {d} are both run {name!r} with seed {seed}, so they are "
                                      "not two seeds: compare one of them (or give the configs different names)")
            by_seed[seed] = d
    if not groups:
        raise CheckpointError("no completed run to compare: " + "; ".join(left_out))
    return groups, left_out
