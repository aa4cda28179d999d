"""Paired differences: a method against a baseline seed by seed, where both ran on the same
per-client label counts (``fedhet compare --paired``, a sweep's ``paired:``)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from fedhet.core.errors import CheckpointError
from fedhet.experiment.report.runs import group_runs
from fedhet.experiment.report.stats import mean_std
from fedhet.experiment.rundir import PARTITION
from fedhet.experiment.summary import selected_value


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
    no_metric: dict[str, list[int]] = defaultdict(list)       # name -> seeds whose run recorded no m
    rounds = {(name, int(s["seed"])): s.get("rounds_completed") for name, runs in groups.items() for _, s in runs}
    uneven: list[str] = []                                    # pairs of runs of different lengths
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
            if m and not s["metrics"].get(m):
                no_metric[name].append(seed)
                continue
            for base in tables_of:
                finals[base][name][seed] = s["metrics"][m]["final"]
                if (v := selected_value(s, m)) is not None:
                    chosen[base][name][seed] = v

    seen_pairs: set[frozenset] = set()       # a pair of baselines is one pair, in either table
    for base in names:
        for name, by_seed in finals[base].items():
            for seed in sorted(set(by_seed) & set(finals[base].get(base, {}))):
                pair = frozenset({(name, seed), (base, seed)})
                if name != base and pair not in seen_pairs and rounds[(name, seed)] != rounds[(base, seed)]:
                    seen_pairs.add(pair)
                    uneven.append(f"{name} s{seed} ({rounds[(name, seed)]} rounds against {base}'s "
                                  f"{rounds[(base, seed)]})")
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
    if no_metric:
        tables.append(f"Not paired where the run recorded no {m}: {_seed_list(no_metric)}.")
    if uneven:
        tables.append("Paired runs of different lengths, whose final values come from different rounds: "
                      + ", ".join(uneven) + ".")
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
