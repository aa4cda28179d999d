"""A sweep's verdicts: claims written into the sweep file before its first run, decided from whatever
runs are complete (wherever they were made: committed run folders count as much as fresh ones).

A sweep file's ``verdicts`` list::

    verdicts:
      - claim: FedClassAvg > Local on Dir(0.5)      # what is being tested, in words
        rule: every_seed                            # or most_seeds, best_at_seed
        better: dir0.5_fedclassavg                  # the tag (group) claimed better
        than: dir0.5_local                          # one tag, or a list of tags
        seeds: [0, 1, 2]                            # the seeds the claim needs
        metric: personal_acc                        # default: the sweep's metric, else the runs' headline
        value: final                                # final (default), best, lowest:METRIC or highest:METRIC
        margin: 0.0                                 # best_at_seed: a difference within it is a tie

Rules, compared seed by seed (a seed fixes the partition and the client sampling, so one seed of two
methods is a pair):

* ``every_seed``: "reproduced" when ``better`` is above each ``than`` at every seed, "not reproduced"
  when below at every seed, else "inconclusive".
* ``most_seeds``: "reproduced" when ``better`` is above each ``than`` at every seed, "not reproduced"
  when above at no more than half of the (``than``, seed) pairs, else (above at more than half, not
  all) "inconclusive": with 3 seeds, ahead at 3 is reproduced, at 2 inconclusive, at 1 or 0 not.
* ``best_at_seed``: "reproduced" when ``better`` is above each ``than`` by more than ``margin`` at
  every seed, "not reproduced" when some ``than`` is above it by more than ``margin``, else "tie".

A claim whose runs are not all complete is "pending", with the runs it still needs and, where the
complete pairs already rule "reproduced" out, the pairs that do (for ``best_at_seed``, a pair within
the margin: the claim can then only end "tie" or "not reproduced"). What no later seed can change is
decided at once: ``every_seed`` is "inconclusive" as soon as one complete pair is at or below and
one at or above (neither direction can hold at every seed any more), and ``best_at_seed`` is "not
reproduced" as soon as one complete pair says so; ``most_seeds`` is "not reproduced" as soon as the
pairs still missing could not lift the pairs above past half, "inconclusive" as soon as more than half
are above and one is not. One whose
complete runs lack its metric "cannot be decided", with the metrics they have. ``value:
lowest:personal_loss`` is the metric at the evaluated round with the lowest ``personal_loss`` (the
first such round), read from the run's ``metrics.jsonl``; ``highest:global_val_acc`` likewise at the
round with the highest validation accuracy (the FedFM paper's selection rule).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhet.core.errors import ConfigError
from fedhet.experiment.config import RUN_VALUE_PATTERN
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import model_selection, selected_value

RULES = ("every_seed", "most_seeds", "best_at_seed")
KEYS = {"claim", "rule", "better", "than", "seeds", "metric", "value", "margin"}


@dataclass(frozen=True)
class Verdict:
    claim: str
    rule: str
    better: str
    than: tuple[str, ...]
    seeds: tuple[int, ...]
    metric: str | None = None
    value: str = "final"
    margin: float = 0.0


class MissingValue(Exception):
    """A completed run that lacks the number a claim asks for (a metric it never recorded)."""


def parse_verdicts(raw: Any, where: str, runs: set[tuple[str, int]]) -> list[Verdict]:
    """The sweep file's ``verdicts`` list, checked: known keys and rules, runs (tag, seed) the sweep has."""
    tags = {tag for tag, _ in runs}
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: 'verdicts' must be a list of claims (see fedhet.experiment.verdict)")
    out = []
    for i, entry in enumerate(raw):
        at = f"{where}: verdicts[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at} must be a mapping with claim, rule, better, than and seeds")
        unknown = set(entry) - KEYS
        if unknown:
            raise ConfigError(f"{at}: unknown keys {sorted(unknown)}; known: {', '.join(sorted(KEYS))}")
        missing = [k for k in ("claim", "rule", "better", "than", "seeds") if k not in entry]
        if missing:
            raise ConfigError(f"{at} needs {', '.join(missing)}")
        if entry["rule"] not in RULES:
            raise ConfigError(f"{at}: rule {entry['rule']!r} is not one of {', '.join(RULES)}")
        than = entry["than"] if isinstance(entry["than"], list) else [entry["than"]]
        if not than:
            raise ConfigError(f"{at}: 'than' names no tag to compare with")
        for tag in [entry["better"], *than]:
            if str(tag) not in tags:
                raise ConfigError(f"{at}: {tag!r} is not a tag of this sweep (tags: {', '.join(sorted(tags))})")
        seeds = entry["seeds"]
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                                for s in seeds):
            raise ConfigError(f"{at}: seeds must be a non-empty list of whole numbers, got {seeds!r}")
        absent = [f"{t}_s{sd}" for t in [entry["better"], *than] for sd in seeds if (str(t), sd) not in runs]
        if absent:
            raise ConfigError(f"{at}: the sweep runs no {', '.join(absent)}; list those seeds in its runs, or claim "
                              "fewer seeds")
        value = str(entry.get("value", "final"))
        if not re.fullmatch(RUN_VALUE_PATTERN, value):
            raise ConfigError(f"{at}: value {value!r} is not final, best, lowest:METRIC or highest:METRIC")
        margin = entry.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 0:
            raise ConfigError(f"{at}: margin must be a number of at least 0, got {margin!r}")
        out.append(Verdict(str(entry["claim"]), entry["rule"], str(entry["better"]), tuple(map(str, than)),
                           tuple(seeds), entry.get("metric"), value, float(margin)))
    return out


def run_value(run_dir: Path, summary: dict, metric: str, value: str) -> float | None:
    """One run's number for a claim: its summary's final or best of ``metric``, or ``metric`` at the
    first evaluated round where another metric is lowest (``lowest:``) or highest (``highest:``)."""
    if value in ("final", "best"):
        entry = (summary.get("metrics") or {}).get(metric)
        return None if not entry else entry[value]
    extreme, by = value.split(":", 1)
    if extreme == "highest" and by == "global_val_acc" and (chosen := selected_value(summary, metric)) is not None:
        return chosen          # the summary's own best-validation rule, from every row (a cut metrics.jsonl too)
    if extreme == "highest":
        return model_selection(read_metrics(run_dir), selected_by=by, report=metric).get("value")
    rows = [r for r in read_metrics(run_dir) if r.get(by) is not None and r.get(metric) is not None]
    if not rows:
        return None
    return min(rows, key=lambda r: (r[by], r["round"]))[metric]


def decide(verdict: Verdict, value_of: Callable[[str, int], float | None]) -> tuple[str, str]:
    """``(outcome, detail)`` of one claim; ``value_of(tag, seed)`` is None for a run not complete."""
    found = {(t, s): value_of(t, s) for t in (verdict.better, *verdict.than) for s in verdict.seeds}
    needed = [key for key, v in found.items() if v is None]
    known = {key: float(v) for key, v in found.items() if v is not None}
    diffs = {(t, s): known[verdict.better, s] - known[t, s] for t in verdict.than for s in verdict.seeds
             if (verdict.better, s) in known and (t, s) in known}

    def pairs(keep: Callable[[float], bool] = lambda d: True) -> str:
        return ", ".join(f"{t} s{s}: {100 * d:+.2f}" for (t, s), d in diffs.items() if keep(d))

    detail = pairs()
    runs_needed = ", ".join(f"{t}_s{s}" for t, s in needed)
    missing, decided = f"needs {runs_needed}", f"{detail} (decided before {runs_needed} ran)"
    if verdict.rule == "most_seeds":
        return _most_seeds(diffs, len(verdict.than) * len(verdict.seeds), missing if needed else None,
                           decided if needed else detail)
    if needed:
        against = pairs(lambda d: d < -verdict.margin or (verdict.rule == "every_seed" and d <= 0))
        if verdict.rule == "best_at_seed" and against:    # no later seed can undo a loss beyond the margin
            return "not reproduced", decided
        if verdict.rule == "every_seed" and against and any(d >= 0 for d in diffs.values()):
            return "inconclusive", decided                # neither "every seed above" nor "below" can hold
        if against:                                       # every_seed: not all above any more
            return "pending", f"{missing}; reproduced is already ruled out by {against}"
        ties = pairs(lambda d: d <= verdict.margin)
        if verdict.rule == "best_at_seed" and ties:       # not above by the margin: at best a tie now
            return "pending", (f"{missing}; reproduced is already ruled out by {ties} (within the "
                               f"{100 * verdict.margin:g}-point margin), so the outcome is tie or not reproduced")
        return "pending", missing
    if verdict.rule == "every_seed":
        if all(d > 0 for d in diffs.values()):
            return "reproduced", detail
        if all(d < 0 for d in diffs.values()):
            return "not reproduced", detail
        return "inconclusive", detail
    if all(d > verdict.margin for d in diffs.values()):
        return "reproduced", detail
    if any(d < -verdict.margin for d in diffs.values()):
        return "not reproduced", detail
    return "tie", detail


def _most_seeds(diffs: dict[tuple[str, int], float], pairs: int, missing: str | None,
                detail: str) -> tuple[str, str]:
    """The ``most_seeds`` rule over ``pairs`` (than, seed) pairs, ``diffs`` those complete so far;
    ``missing`` says which runs are not complete (None: all are), ``detail`` goes with an outcome."""
    above = sum(d > 0 for d in diffs.values())
    not_above = len(diffs) - above
    if missing is None:
        if not not_above:
            return "reproduced", detail
        return ("not reproduced" if 2 * above <= pairs else "inconclusive"), detail
    if 2 * (above + pairs - len(diffs)) <= pairs:         # above at no more than half, whatever the rest give
        return "not reproduced", detail
    if 2 * above > pairs and not_above:                   # more than half above, not all: nothing can change it
        return "inconclusive", detail
    return "pending", missing + ("; reproduced is already ruled out" if not_above else "")


def verdict_table(verdicts: list[Verdict], value_of: Callable[[Verdict, str, int], float | None],
                  default_metric: str | None = None) -> str:
    """Markdown: each claim, its rule and the outcome, with the per-seed differences (points);
    ``default_metric`` names the metric of claims that name none (else the runs' headline)."""
    lines = ["| claim | rule | metric | outcome | better minus each other, per seed (points) |",
             "|---|---|---|---|---|"]
    for v in verdicts:
        try:
            outcome, detail = decide(v, lambda tag, seed, v=v: value_of(v, tag, seed))
        except MissingValue as e:
            outcome, detail = "cannot be decided", str(e)
        rule = v.rule + (f" (margin {100 * v.margin:g} points)" if v.rule == "best_at_seed" else "")
        lines.append(f"| {v.claim} | {rule}, seeds {list(v.seeds)} | {v.metric or default_metric or 'headline'} ({v.value}) "
                     f"| **{outcome}** | {detail} |")
    return "\n".join(lines)
