"""Plots written by runs and commands: PNG files through matplotlib's object API.

No pyplot: a figure here belongs to no backend and no global registry, so importing or running
fedhet leaves a notebook's backend and open figures alone. matplotlib is imported on the first
plot, not with this module (a process that writes no plot never loads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedhet.core.errors import OutputError


def figure(width: float, height: float) -> tuple[Any, Any]:
    """A new figure with one axes, outside pyplot (nothing to close afterwards)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def whole_numbers(axis: Any) -> None:
    """Ticks at whole numbers only (rounds, clients)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def save(fig: Any, path: Path) -> None:
    """Write a figure as PNG; a path that cannot be written is an OutputError saying which and why."""
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise OutputError(f"cannot write the plot {path}: {e.strerror or e}; choose another path "
                          "(its folder must exist and be writable)") from None
    except ValueError as e:          # a format matplotlib does not write (plot_path checks it first)
        raise OutputError(f"cannot write the plot {path}: {e}") from None


def plot_path(given: str, option: str) -> Path:
    """The file a command's ``option`` (``--plot``, ``--out``) names for a plot, checked before any
    work: PNG where it has no suffix (as matplotlib writes it), a format matplotlib writes, a
    folder that exists, not a folder itself. An OutputError says what to give instead."""
    if not given.strip():
        raise OutputError(f"{option} is empty: name the plot's file, e.g. {option} compare.png")
    path = Path(given)
    if path.is_dir() or given.endswith(("/", "\\")):
        if not path.is_dir():
            raise OutputError(f"{option} {given} names a folder, and it does not exist: name a file, e.g. "
                              f"{option} {path / 'plot.png'}")
        raise OutputError(f"{option} {path} is a folder: name a file in it, e.g. {option} {path / 'plot.png'}")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise OutputError(f"{option} {given}: matplotlib writes no {path.suffix} files; name a .png (or "
                          f"{', '.join('.' + f for f in sorted(formats) if f in ('pdf', 'svg', 'jpg'))}) file")
    if not path.parent.is_dir():
        raise OutputError(f"{option} {given}: cannot write there, {path.parent} is not a folder; make it, or "
                          "choose another path")
    return path

CURVES = (("global_acc", "global model, global test set"),
          ("global_labeldist_acc", "global model, client label-distribution weighted"),
          ("personal_acc", "each client's model, its local test split (mean)"))


def one_round_view(ax: Any, rounds: set[int]) -> None:
    """Where every curve has one point: a round on each side, so the axis holds whole rounds."""
    if len(rounds) == 1:
        (only,) = rounds
        ax.set_xlim(only - 1, only + 1)


def plot_run(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = figure(7, 4.2)
    rounds: set[int] = set()
    for key, label in CURVES:
        pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            x, y = zip(*pts)
            ax.plot(x, np.array(y) * 100, label=label, marker="o" if len(x) == 1 else None)   # one point shows
            rounds.update(x)
    ax.set_xlabel("round")
    whole_numbers(ax.xaxis)     # rounds are whole
    one_round_view(ax, rounds)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:       # e.g. a method without a global model, run with eval.personalized=false
        ax.text(0.5, 0.5, "no accuracy was evaluated", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    save(fig, path)


def plot_compare(series: dict[str, list[list[tuple[int, float]]]], metric: str, path: Path,
                 title: str | None = None) -> None:
    """Overlay: one line per group (mean over its seeds), shaded min..max band."""
    fig, ax = figure(7, 4.2)
    shown: set[int] = set()
    for label, all_runs in series.items():
        runs = [run for run in all_runs if run]      # a seed without rows (named in the table's notes)
        if not runs:
            continue
        rounds = sorted(set.intersection(*[{r for r, _ in run} for run in runs]))
        if not rounds:
            continue
        vals = np.array([[dict(run)[r] for r in rounds] for run in runs]) * 100
        ax.plot(rounds, vals.mean(0), label=f"{label} (n={len(runs)})", marker="o" if len(rounds) == 1 else None)
        if len(runs) > 1:
            ax.fill_between(rounds, vals.min(0), vals.max(0), alpha=0.2)
        shown.update(rounds)
    ax.set_xlabel("round")
    whole_numbers(ax.xaxis)
    one_round_view(ax, shown)
    ax.set_ylabel(f"{metric} (%)")
    ax.set_title(title or f"{metric} by round, {len(series)} run group(s): mean over seeds, band min..max", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


def plot_partition(counts: np.ndarray, path: Path, title: str) -> None:
    """Client x class heatmap of training sample counts."""
    k, c = counts.shape
    fig, ax = figure(max(5, c * 0.45 + 2), max(3, min(k, 100) * 0.18 + 1.5))
    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(title)
    if c <= 20:
        ax.set_xticks(range(c))
    whole_numbers(ax.yaxis)     # clients are whole
    fig.colorbar(im, ax=ax, label="training samples")
    fig.tight_layout()
    save(fig, path)


def plot_features(embedding: np.ndarray, labels: np.ndarray, path: Path, title: str) -> None:
    """2-d embedding of features, one colour per class (FedFM paper Fig. 6)."""
    fig, ax = figure(6, 5.5)
    classes = np.unique(labels)
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(classes) <= 10 else "tab20"]
    for i, c in enumerate(classes):
        pts = embedding[labels == c]
        ax.scatter(pts[:, 0], pts[:, 1], s=4, color=cmap(i % cmap.N), label=str(c))
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)
    if len(classes) <= 20:
        ax.legend(markerscale=3, fontsize=7, loc="best", title="class")
    fig.tight_layout()
    save(fig, path)
