"""Tables over run directories: ``fedhet compare`` and the table printed after ``fedhet run``; mean ± std
over seeds; and what the per-paper table scripts (``benchmarks/*_table.py``) share: reading a folder
of runs, the lines closing a result file, writing it."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import yaml

from fedhet.core.errors import CheckpointError
from fedhet.experiment.config import ExperimentConfig, flatten_config
from fedhet.experiment.plots import plot_compare
from fedhet.experiment.rundir import CONFIG, PARTITION, read_metrics
from fedhet.experiment.summary import cpu_name, git_commit, machine_info, selected_value
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
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    return paper


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation of ``values`` (a metric over seeds); the std is None for
    a single value."""
    if not values:
        raise ValueError("mean_std of no values")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def format_value(value: float | None, scale: float = 100, spec: str = ".2f") -> str:
    """``value`` times ``scale`` (100: a fraction as a percentage) in ``spec``; - when missing."""
    return "-" if value is None else format(scale * value, spec)


def format_mean_std(values: Sequence[float | None], scale: float = 100, spec: str = ".2f") -> str:
    """``mean ± std`` (sample std) of ``values`` times ``scale``, each in ``spec``: a metric over
    seeds, as a percentage by default. One value: itself; no value, or any missing: -."""
    if not values or any(v is None for v in values):
        return "-"
    mean, std = mean_std([scale * v for v in values if v is not None])
    return format(mean, spec) if std is None else f"{format(mean, spec)} ± {format(std, spec)}"


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


def compare_table(run_dirs: list[Path], metric: str | None = None,
                  grouped: tuple[dict[str, list[tuple[Path, dict]]], list[str]] | None = None) -> tuple[str, dict]:
    """Markdown table grouping runs by config name (seeds pooled), and the curves for plotting.

    When a run's config carries a ``paper`` section, two columns give the paper's number and
    the measured final minus it (mean over seeds), and the notes say which rule each side used."""
    groups, left_out = grouped or group_runs(run_dirs)
    if metric is not None:
        recorded = {m for runs in groups.values() for _, s in runs for m, v in s["metrics"].items() if v}
        if metric not in recorded:
            raise CheckpointError(f"--metric {metric}: no run compared recorded it; recorded: "
                                  f"{', '.join(sorted(recorded)) or 'none'}")
    papers = {name: load_paper(runs[0][0]) for name, runs in groups.items()}
    with_paper = any(papers.values())
    head = "| run | algorithm | metric | seeds | rounds | final (%) | best (%) | s/round |"
    rule = "|---|---|---|---|---|---|---|---|"
    metric_of = {name: metric or runs[0][1]["headline_metric"] for name, runs in groups.items()}
    selected = {name: [v for _, s in runs if (v := selected_value(s, metric_of[name])) is not None]
                for name, runs in groups.items()}
    with_selected = any(selected.values())
    if with_selected:
        head, rule = head + " at best val (%) |", rule + "---|"
    if with_paper:
        head, rule = head + " paper (%) | final - paper |", rule + "---|---|"
    lines = [head, rule]
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    measured_rules: set[str] = set()
    paper_notes: list[str] = []
    unplotted: list[str] = []
    cut: list[str] = []                # metrics.jsonl damaged after some rows: a shorter curve than the table's
    for name, runs in groups.items():
        m = metric_of[name]
        stats = [s["metrics"].get(m, {}) for _, s in runs]
        finals = [x["final"] for x in stats if x]
        bests = [x["best"] for x in stats if x]
        measured_rules.update(x["final_rule"] for x in stats if x.get("final_rule"))
        rounds = sorted({s["rounds_completed"] for _, s in runs})
        spr = [s["seconds_per_round_median"] for _, s in runs if s.get("seconds_per_round_median")]
        spr_text = f"{statistics.median(spr):.2f}" if spr else "-"
        row = (f"| {name} | {runs[0][1]['algorithm']} | {m} | {len(runs)} | {'/'.join(map(str, rounds))} | "
               f"{format_mean_std(finals)} | {format_mean_std(bests)} | {spr_text} |")
        if with_selected:
            row += f" {format_mean_std(selected[name])} |"
        if with_paper:
            row += " " + _paper_cells(papers[name], m, runs) + " |"
        lines.append(row)
        rows_of = [read_metrics(d) for d, _ in runs]
        curves[name] = [[(r["round"], r[m]) for r in rows if r.get(m) is not None] for rows in rows_of]
        unplotted.extend(str(d) for (d, _), curve in zip(runs, curves[name]) if not curve)
        cut.extend(f"{d} (rows up to round {rows[-1]['round']} of {s['rounds_completed']})"
                   for (d, s), rows in zip(runs, rows_of) if rows and rows[-1]["round"] < s["rounds_completed"])
        paper = papers[name]
        if paper:
            where = ", ".join(x for x in (paper.get("source"), paper.get("cell")) if x)
            paper_notes.append(f"- {name}: {where}" + (f"; paper's rule: {paper['rule']}" if paper.get("rule") else ""))
    notes = ("final = mean of the metric over the last evaluations (window in each summary"
             + (f": {'; '.join(sorted(measured_rules))}" if measured_rules else "") + "); "
             "best = max over evaluated rounds; ± = sample std over seeds."
             + (" at best val = the metric at the first round with the highest validation accuracy (the "
                "clients' held-out splits)." if with_selected else ""))
    precisions = {name: sorted({(s.get("precision", "fp32"), s.get("eval_precision", "fp32")) for _, s in runs})
                  for name, runs in groups.items()}
    if len({p for ps in precisions.values() for p in ps}) > 1:     # rounding differs between the rows
        notes += ("\n\nNot every run has the same precision (trained / evaluated): "
                  + "; ".join(f"{name}: {', '.join(f'{t} / {e}' for t, e in ps)}" for name, ps in precisions.items()))
    if left_out:
        notes += "\n\nLeft out (not completed): " + "; ".join(left_out)
    # an interrupted (or still running) run is pooled with the rounds it has, and said so
    unfinished = [f"{d} ({s.get('status')}, {s.get('rounds_completed')} of {s.get('rounds_planned')} rounds)"
                  for runs in groups.values() for d, s in runs if s.get("status") != "completed"]
    if unfinished:
        notes += ("\n\nNot finished, counted with the rounds they have (their final is not the planned run's): "
                  + "; ".join(unfinished))
    if unplotted:
        notes += ("\n\nIn the table from their summaries, but not in the plot (no readable metrics.jsonl rows): "
                  + "; ".join(unplotted))
    if cut:
        notes += ("\n\nIn the table from their summaries, but plotted only as far as their metrics.jsonl is readable: "
                  + "; ".join(cut))
    if paper_notes:
        notes += ("\n\nPaper columns: the number the config's `paper` section gives (± its std); final - paper "
                  "uses the measured mean of the same metric.\n" + "\n".join(paper_notes))
    return "\n".join(lines) + "\n\n" + notes, curves


def _paper_cells(paper: dict | None, metric: str, runs: list[tuple[Path, dict]]) -> str:
    if not paper:
        return "- | -"
    pm = paper.get("metric") or metric
    finals = [s["metrics"][pm]["final"] for _, s in runs if s["metrics"].get(pm)]
    value = 100 * paper["value"]
    text = f"{value:.2f}" + (f" ± {100 * paper['std']:.2f}" if paper.get("std") is not None else "")
    if pm != metric:
        text += f" ({pm})"
    diff = f"{100 * statistics.mean(finals) - value:+.2f}" if finals else "-"
    return f"{text} | {diff}"


def paired_differences(run_dirs: list[Path], bases: str | Sequence[str], metric: str | None = None,
                       grouped: tuple[dict[str, list[tuple[Path, dict]]], list[str]] | None = None) -> str:
    """Markdown tables of the per-seed differences ``final(group) - final(base)``: the paired
    comparison of a method with a baseline, over the seeds at which both ran on the same per-client
    label counts (equal ``partition.json``). Several baselines (one per split of a sweep over two
    splits) give one table each, and a run is paired at a seed with every baseline that ran on its
    data there (baselines on one split with each other too). A run at a seed where no baseline ran,
    where every baseline ran on other data, or where a ``partition.json`` to compare is missing or
    unreadable, is not paired there: lines under the tables name it with those seeds. A second table
    per baseline gives the differences at the best-validation round when its runs recorded it."""
    names = [bases] if isinstance(bases, str) else list(dict.fromkeys(bases))
    if not names:
        raise CheckpointError("--paired: no baseline named")
    groups, _ = grouped or group_runs(run_dirs)
    for base in names:
        if base not in groups:
            raise CheckpointError(f"--paired {base}: no completed run of that name among the runs compared "
                                  f"(names: {', '.join(sorted(groups)) or 'none'})")
    # One metric for every run, so each difference compares like with like: the one asked for,
    # else the first baseline's headline (a personalized method is then judged on it too).
    m = metric or groups[names[0]][0][1]["headline_metric"]
    base_partition = {base: {int(s["seed"]): _partition(d) for d, s in groups[base]} for base in names}
    finals: dict[str, dict[str, dict[int, float]]] = {base: defaultdict(dict) for base in names}
    chosen: dict[str, dict[str, dict[int, float]]] = {base: defaultdict(dict) for base in names}
    no_baseline: dict[str, list[int]] = defaultdict(list)     # name -> seeds no baseline ran
    other_data: dict[str, list[int]] = defaultdict(list)      # name -> seeds on other label counts
    unknown_data: dict[str, list[int]] = defaultdict(list)    # name -> seeds without a partition to compare
    for name, runs in groups.items():
        for d, s in runs:
            seed = int(s["seed"])
            theirs = {base: p[seed] for base, p in base_partition.items() if base != name and seed in p}
            mine = None
            if theirs:          # a baseline's own file was read above
                mine = base_partition[name][seed] if name in base_partition else _partition(d)
            tables_of = [base for base, p in theirs.items() if mine is not None and p == mine]
            if name in base_partition:
                tables_of.append(name)              # a baseline's own table holds its values
            elif not tables_of:
                if not theirs:
                    no_baseline[name].append(seed)
                elif mine is None or None in theirs.values():
                    unknown_data[name].append(seed)
                else:
                    other_data[name].append(seed)
                continue
            for base in tables_of:
                if m and s["metrics"].get(m):
                    finals[base][name][seed] = s["metrics"][m]["final"]
                if m and (v := selected_value(s, m)) is not None:
                    chosen[base][name][seed] = v
    tables = []
    for base in names:
        if base not in finals[base]:
            where = "" if metric else f" (the headline metric of {names[0]}; choose another with --metric)"
            raise CheckpointError(f"--paired {base}: its runs recorded no {m}{where} to pair with (names: "
                                  f"{', '.join(sorted(groups))})")
        tables.append(_paired_table(finals[base], base, f"Paired differences of final {m} against {base} "
                                                         "(percentage points, per seed):"))
        if base in chosen[base]:
            tables.append(_paired_table(chosen[base], base, f"Paired differences of {m} at the best-validation "
                                                            f"round against {base} (percentage points, per seed):"))
    one = len(names) == 1
    who = names[0] if one else "any of " + ", ".join(names)
    if no_baseline:
        none_ran = f"{who} has no run" if one else "none of them has a run"
        tables.append(f"Not paired with {who} where {none_ran} of the seed: {_seed_list(no_baseline)}.")
    if other_data:
        theirs_of_seed = "its run" if one else "their runs"
        tables.append(f"Not paired with {who} where they ran on other per-client label counts than {theirs_of_seed} "
                      f"of the seed (another partition.json): {_seed_list(other_data)}.")
    if unknown_data:
        runs_compared = "one of the two runs has" if one else "the run or a baseline's run of the seed has"
        tables.append(f"Not paired with {who} where {runs_compared} no readable partition.json to tell "
                      f"whether they ran on the same data: {_seed_list(unknown_data)}.")
    return "\n\n".join(tables)


def _partition(run_dir: Path) -> object | None:
    """A run's per-client label counts (its ``partition.json``), to tell whether two runs of one seed
    can be paired; None when the file is missing or unreadable."""
    try:
        return json.loads((Path(run_dir) / PARTITION).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _seed_list(seeds_by_name: dict[str, list[int]]) -> str:
    return ", ".join(f"{name} ({', '.join(f's{s}' for s in sorted(seeds))})" for name, seeds in sorted(seeds_by_name.items()))


def _paired_table(values: dict[str, dict[int, float]], base: str, title: str) -> str:
    lines = [title, "", "| run | seeds | per seed | mean ± std | differences > 0 |", "|---|---|---|---|---|"]
    for name, by_seed in values.items():
        if name == base:
            continue
        seeds = sorted(set(by_seed) & set(values[base]))
        diffs = [100 * (by_seed[s] - values[base][s]) for s in seeds]
        if not diffs:
            lines.append(f"| {name} | none shared | - | - | - |")
            continue
        mean, std = mean_std(diffs)
        spread = f"{mean:+.2f}" + (f" ± {std:.2f}" if std is not None else "")
        per_seed = ", ".join(f"s{s}: {d:+.2f}" for s, d in zip(seeds, diffs))
        lines.append(f"| {name} | {len(diffs)} | {per_seed} | {spread} | {sum(d > 0 for d in diffs)}/{len(diffs)} |")
    return "\n".join(lines)


def compare(run_dirs: list[Path], metric: str | None, plot_path: Path | None,
            paired: str | Sequence[str] | None = None) -> str:
    grouped = group_runs(run_dirs)          # each summary read once
    table, curves = compare_table(run_dirs, metric, grouped)
    if plot_path is not None:
        plot_compare(curves, metric or "headline accuracy", plot_path)
    if paired:
        table += "\n\n" + paired_differences(run_dirs, paired, metric, grouped)
    return table


# The per-paper table scripts (benchmarks/*_table.py): a folder of run directories in, a result
# file (Markdown, JSON, plot) out; each script keeps only its paper's layout, columns and numbers.

def read_run_folder(folder: Path) -> tuple[list[tuple[Path, dict]], list[tuple[str, int, str]]]:
    """The run directories directly under ``folder``, by name: the completed ones with their
    summaries, and the others as (name, rounds recorded, why): the summary's error or status, or
    "no summary.json" (rounds counted in its metrics.jsonl)."""
    completed: list[tuple[Path, dict]] = []
    unfinished: list[tuple[str, int, str]] = []
    for d in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        if not (d / "summary.json").is_file():
            rounds = len(read_metrics(d)) if (d / "metrics.jsonl").is_file() else 0
            unfinished.append((d.name, rounds, "no summary.json"))
            continue
        summary = load_summary(d)
        if summary["status"] != "completed":
            unfinished.append((d.name, summary["rounds_completed"], summary.get("error") or summary["status"]))
            continue
        completed.append((d, summary))
    return completed, unfinished


def unfinished_lines(unfinished: list[tuple[str, int, str]]) -> list[str]:
    """Markdown lines naming the runs a table left out (``read_run_folder``'s second list); none
    when there are none."""
    if not unfinished:
        return []
    return ["", "Runs that did not finish (left out of the table above):", "",
            *(f"- `{name}`: {rounds} rounds recorded; {why}" for name, rounds, why in unfinished)]


def provenance_lines(runs: Sequence[Path], others_differ_in: str, machine: dict | None = None) -> list[str]:
    """Markdown lines closing a result file: the machine the table is made on (``machine``, default
    this one's ``machine_info``), the commits and CPUs the ``runs`` were made at (their summaries)
    and the table's commit, and the first run's config, the others differing in ``others_differ_in``."""
    m = machine or machine_info()
    made: dict[tuple[str, str], int] = defaultdict(int)
    for run in runs:
        recorded = load_summary(run).get("machine") or {}
        made[str(recorded.get("commit")), cpu_name(recorded)] += 1
    where = "; ".join(f"{commit} on {cpu} ({n} run{'s' if n > 1 else ''})" for (commit, cpu), n in made.items())
    return ["", f"Machine: {cpu_name(m)}, {m['cpus']} CPUs, torch {m['torch']}; runs at {where}; table at commit "
            f"{git_commit()}.", "",
            f"Config of the first run (the others differ in {others_differ_in}):", "", "```yaml",
            (Path(runs[0]) / CONFIG).read_text().strip(), "```", ""]


def write_result_files(out: Path, stem: str, lines: list[str], payload: dict,
                       curves: dict[str, list[list[tuple[int, float]]]], metric: str) -> str:
    """``out/<stem>.md`` (the lines), ``<stem>.json`` (the payload) and ``<stem>.png`` (the curves
    of ``metric``, as ``fedhet compare`` plots them); returns the Markdown text."""
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    plot_compare(curves, metric, out / f"{stem}.png")
    return text
