"""The sweep file read into its jobs: one per (run entry, grid point, seed), each with its run
directory and overrides; nothing is started here."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhet.core.errors import ConfigError
from fedhet.experiment.config import override_key
from fedhet.experiment.summary import SUMMARIZED_METRICS
from fedhet.experiment.verdict import Verdict, parse_verdicts
from fedhet.experiment.yaml_io import read_yaml


@dataclass
class Job:
    tag: str                  # group name (config name of the run): seeds of one tag are pooled
    seed: int
    config: Path
    overrides: list[str]
    run_dir: Path
    run_tag: str = ""         # the sweep file's tag of the run entry (the group name without a grid suffix)
    costs_like: str = ""      # the group whose completed runs say how long it takes while its own has none

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass
class Sweep:
    name: str
    out: Path
    lanes: int
    jobs: list[Job]
    metric: str | None = None
    source: Path | None = None
    notes: list[str] = field(default_factory=list)
    paired: list[str] = field(default_factory=list)  # baseline tags for per-seed paired differences (one a split)
    extra_set: list[str] = field(default_factory=list)   # the command line's --set, applied to every run
    verdicts: list[Verdict] = field(default_factory=list)  # claims fixed before the runs, decided from them
    out_given: bool = False      # out came from the command line (--out), not the sweep file


def _as_list(value: Any, what: str, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: '{what}' must be a list, got {value!r}")
    return value


def _seeds(value: Any, where: str) -> list[int]:
    """A run list's seeds: whole numbers (a seed names the run's folder, ``TAG_sSEED``, and its
    random streams; 1.5 or true would name one folder and seed another)."""
    seeds = _as_list(value, "seeds", where)
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int)]
    if bad:
        raise ConfigError(f"{where}: seeds must be whole numbers, e.g. seeds: [0, 1, 2]; got {bad!r}")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"{where}: seeds {seeds} list seed(s) {twice} more than once; a seed is one run - "
                          "list each once")
    return seeds


def _folder_name(value: Any, what: str, where: str, part: bool = False) -> str:
    """A sweep's name or a run entry's tag (or, ``part``, a grid value inside one): each becomes a
    folder's name, so it may not leave the sweep's folder (``../x``) or make nested ones (``a/b``)."""
    text = str(value)
    if "/" in text or "\\" in text or not part and (not text or text.startswith(".")):
        names = "is part of its runs' folder names" if part else "names a folder"
        raise ConfigError(f"{where}: {what} {text!r} {names}, so it may not hold a slash"
                          + ("" if part else ", be empty or start with a dot") + "; use letters, digits, '-' and '_'"
                          + (" (or give such values as separate run entries with their own tags)" if part else ""))
    return text


def _grid_points(grid: dict[str, list]) -> list[tuple[str, list[str]]]:
    """(suffix, overrides) for every combination of the grid (one empty point without a grid)."""
    if not grid:
        return [("", [])]
    keys = list(grid)
    for k in keys:
        if not isinstance(grid[k], list) or not grid[k]:
            raise ConfigError(f"sweep grid: '{k}' needs a non-empty list of values")
        for v in grid[k]:
            _folder_name(v, "value", f"sweep grid: '{k}'", part=True)   # a part of its runs' folder names
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        suffix = "_".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in zip(keys, values))
        points.append((suffix, [f"{k}={v}" for k, v in zip(keys, values)]))
    return points


def load_sweep(path: str | Path, out: str | Path | None = None, lanes: int | None = None,
               extra_set: list[str] | None = None) -> Sweep:
    """Read and check a sweep file; every job is listed, none is started. ``extra_set`` (the
    command line's ``--set``) applies to every run, after the file's own ``set`` lists."""
    path = Path(path)
    raw = read_yaml(path, "sweep file")
    if not isinstance(raw, dict) or not raw.get("runs"):
        raise ConfigError(f"{path}: a sweep file is a mapping with a non-empty 'runs' list (see fedhet sweep --help)")
    unknown = set(raw) - {"name", "out", "lanes", "seeds", "set", "grid", "runs", "metric", "paired", "verdicts"}
    if unknown:
        raise ConfigError(f"{path}: unknown sweep keys {sorted(unknown)}; "
                          "known: name, out, lanes, seeds, set, grid, runs, metric, paired, verdicts")
    name = _folder_name(raw.get("name") or path.stem, "name", str(path))
    metric = raw.get("metric")
    if metric is not None and metric not in SUMMARIZED_METRICS:     # the table reads the runs' summaries
        raise ConfigError(f"{path}: metric {metric!r} is not one a run's summary holds; one of: "
                          f"{', '.join(SUMMARIZED_METRICS)}")
    out_dir = Path(out or raw.get("out") or Path("runs") / name)
    if out_dir.exists() and not out_dir.is_dir():
        given = "--out" if out else f"{path}: out" if raw.get("out") else f"{path}: the output folder runs/<name>"
        raise ConfigError(f"{given} {out_dir} is a file: name a folder for the sweep's runs")
    lanes_from, n_lanes = ("--lanes", lanes) if lanes is not None else (f"{path}: lanes", raw.get("lanes", 1))
    if isinstance(n_lanes, bool) or not isinstance(n_lanes, int) or n_lanes < 1:
        raise ConfigError(f"{lanes_from} must be a whole number of at least 1, got {n_lanes!r}")
    seeds = _seeds(raw.get("seeds", [0]), str(path))
    common = [str(s) for s in _as_list(raw.get("set"), "set", str(path))]
    _refuse_threads_in_file(common, str(path))
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"{path}: 'grid' must map config keys to lists of values")
    jobs: list[Job] = []
    seen: dict[Path, str] = {}
    tag_owner: dict[str, tuple[str, list[str], str, str]] = {}
    costs_like: list[tuple[str, str, str]] = []     # (where, tag, the tag it costs like)
    for i, entry in enumerate(_as_list(raw["runs"], "runs", str(path))):
        where = f"{path}: runs[{i}]"
        if isinstance(entry, str):
            entry = {"config": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), str) or not entry["config"]:
            raise ConfigError(f"{where} needs a 'config': a path, relative to the working directory"
                              + (f", got {entry['config']!r}" if isinstance(entry, dict) and "config" in entry else ""))
        extra = set(entry) - {"config", "tag", "seeds", "set", "costs_like"}
        if extra:
            raise ConfigError(f"{where}: unknown keys {sorted(extra)}; known: config, tag, seeds, set, costs_like")
        config = Path(entry["config"])
        if not config.is_file():
            # the folder its paths start from: the sweep file's own, or one above it (a repository's root)
            start = next((d for d in path.resolve().parents if (d / config).is_file()), None)
            fix = (f"run fedhet sweep from {start}, where the path is" if start is not None and not config.is_absolute()
                   else "run fedhet sweep from the folder the sweep file's paths start from, or fix the path")
            raise ConfigError(f"{where}: config {config} does not exist (working directory {Path.cwd()}); a run's "
                              f"config path is relative to the working directory: {fix}")
        tag = _folder_name(entry.get("tag") or config.stem, "tag", where)
        run_seeds = _seeds(entry.get("seeds", seeds), where)
        own = [str(s) for s in _as_list(entry.get("set"), "set", where)]
        _refuse_threads_in_file(own, where)
        like = "" if entry.get("costs_like") is None else str(entry["costs_like"])
        if like:
            costs_like.append((where, tag, like))
        first = tag_owner.setdefault(tag, (str(config), own, like, where))
        if first[:3] != (str(config), own, like):
            raise ConfigError(f"{where}: tag {tag!r} is also used by {first[3]} for another config, 'set' or "
                              "'costs_like'; runs of one tag are pooled as seeds of one experiment - give it "
                              "another tag")
        for suffix, grid_set in _grid_points(grid):
            group = f"{tag}_{suffix}" if suffix else tag
            for seed in run_seeds:
                run_dir = out_dir / f"{group}_s{seed}"
                if run_dir in seen:
                    raise ConfigError(f"{where}: run directory {run_dir} is also made by {seen[run_dir]}; "
                                      "give the runs different tags")
                seen[run_dir] = where
                overrides = [*common, *own, *grid_set, *(extra_set or []), f"seed={seed}", f"name={group}"]
                jobs.append(Job(group, int(seed), config, overrides, run_dir, tag,
                                f"{like}_{suffix}" if like and suffix else like))
    # one baseline tag, or a list of them (one a split, each run paired with the one on its data)
    paired = raw.get("paired")
    if paired is None:
        paired = []
    elif not isinstance(paired, list):
        paired = [paired]
    paired = [str(tag) for tag in paired]
    groups = {j.tag for j in jobs}
    for tag in paired:
        if tag not in groups:
            raise ConfigError(f"{path}: paired: {tag!r} is not the tag of any run (tags: {', '.join(sorted(groups))})")
    for where, tag, like in costs_like:
        if like == tag or like not in tag_owner:
            raise ConfigError(f"{where}: costs_like: {like!r} is not the tag of another run entry (tags: "
                              f"{', '.join(sorted(tag_owner))})")
    verdicts = parse_verdicts(raw.get("verdicts"), str(path), {(j.tag, j.seed) for j in jobs})
    return Sweep(name, out_dir, n_lanes, jobs, metric, path,
                 paired=paired, extra_set=list(extra_set or []),
                 verdicts=verdicts, out_given=out is not None)


def _refuse_threads_in_file(items: list[str], where: str) -> None:
    # each run is started with the sweep's --threads, which a file's run.threads would silently lose to
    if any(override_key(item) == "run.threads" for item in items):
        raise ConfigError(f"{where}: run.threads in a sweep file's 'set' would be overridden by the lanes' share "
                          "(usable CPUs // lanes); leave it out, and give it on the command line instead: "
                          "fedhet sweep FILE --set run.threads=N")


def select_jobs(sweep: Sweep, only: list[str] | None) -> list[Job]:
    """The jobs named by ``only`` (the command line's ``--only``; all jobs without it): a run
    entry's tag (every grid point of it) or one group (tag plus grid suffix, as in the run folder
    names). A name that is neither is an error that lists the sweep's names."""
    if not only:
        return list(sweep.jobs)
    wanted = set(only)
    names = {j.tag for j in sweep.jobs} | {j.run_tag for j in sweep.jobs}
    unknown = [name for name in dict.fromkeys(only) if name not in names]
    if unknown:
        raise ConfigError(f"--only {', '.join(unknown)}: no run of sweep {sweep.name!r} has this tag; "
                          f"its tags and groups: {', '.join(sorted(names))}")
    return [j for j in sweep.jobs if j.tag in wanted or j.run_tag in wanted]
