"""fedhet's plots leave a user's matplotlib alone: no pyplot, no backend switched, and nothing of
matplotlib loaded by importing the report or plot modules, only when a plot is written (a fresh
process, so no other test's imports count)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedhet.core.errors import OutputError
from fedhet.experiment.plots import plot_compare, plot_run

USER_SESSION = """
import sys
import fedhet.experiment.report                # what `fedhet compare` and the table scripts import
from fedhet.experiment.plots import plot_features, plot_partition, plot_run
print("loaded at import:", "matplotlib" in sys.modules)
import matplotlib
matplotlib.use("svg")                          # the user's own choice, made before fedhet plots
rows = [{"round": r, "global_acc": 0.1 * r, "personal_acc": 0.2 * r} for r in (1, 2, 3)]
plot_run(rows, sys.argv[1], "a run")
import numpy as np
plot_partition(np.array([[3, 0], [1, 2]]), sys.argv[2], "two clients")
plot_features(np.array([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]), np.array([0, 1, 1]), sys.argv[3], "features")
print("backend:", matplotlib.get_backend(), "pyplot:", "matplotlib.pyplot" in sys.modules)
"""


def test_plots_load_matplotlib_on_first_use_and_keep_the_users_backend(tmp_path):
    pngs = [tmp_path / "run.png", tmp_path / "partition.png", tmp_path / "features.png"]
    done = subprocess.run([sys.executable, "-c", USER_SESSION, *map(str, pngs)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["loaded at import: False", "backend: svg pyplot: False"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_a_plot_that_cannot_be_written_says_where_and_one_that_can_is_written(tmp_path):
    with pytest.raises(OutputError, match=r"cannot write the plot .*missing.*choose another path"):
        plot_run([{"round": 1, "global_acc": 0.5}], tmp_path / "missing" / "run.png", "a run")
    series = {"fedavg": [[(1, 0.5), (2, 0.6)], [(1, 0.4), (2, 0.7)]]}
    plot_compare(series, "global_acc", tmp_path / "compare.png")
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_accuracies_is_plotted_without_a_legend_warning(tmp_path, recwarn):
    # a method without a global model, evaluated without its personal models: nothing to draw
    plot_run([{"round": 1, "train_loss": 0.5}, {"round": 2, "train_loss": 0.4}], tmp_path / "run.png", "a run")
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [str(w.message) for w in recwarn.list if "legend" in str(w.message)]


def test_a_plots_path_is_checked_before_any_work_and_named_as_written(tmp_path):
    from fedhet.experiment.plots import plot_path

    assert plot_path(str(tmp_path / "c"), "--plot") == tmp_path / "c.png"          # matplotlib's own default
    assert plot_path(str(tmp_path / "c.svg"), "--plot") == tmp_path / "c.svg"
    for given, said in [("", "--plot is empty: name the plot's file"),
                        (str(tmp_path), "is a folder: name a file in it"),
                        (str(tmp_path / "c.xyz"), "matplotlib writes no .xyz files; name a .png"),
                        (str(tmp_path / "no" / "c.png"), "cannot write there, .*no is not a folder"),
                        (str(tmp_path / "out") + "/", "names a folder, and it does not exist: name a file")]:
        with pytest.raises(OutputError, match=said):
            plot_path(given, "--plot")


def test_a_seed_without_rows_leaves_its_group_plotted_and_one_round_shows(tmp_path, monkeypatch):
    import fedhet.experiment.plots as plots

    drawn = []
    monkeypatch.setattr(plots, "save", lambda fig, path: drawn.append(fig.axes[0]))
    plot_compare({"fedavg": [[(1, 0.5), (2, 0.6)], []], "local": [[(1, 0.4)]]}, "global_acc", tmp_path / "c.png")
    lines = {line.get_label(): line for line in drawn[0].lines}
    assert list(lines) == ["fedavg (n=1)", "local (n=1)"]                 # n: the seeds drawn
    assert list(lines["fedavg (n=1)"].get_xdata()) == [1, 2] and lines["local (n=1)"].get_marker() == "o"
    plot_run([{"round": 3, "global_acc": 0.5}], tmp_path / "r.png", "one round")
    assert drawn[1].lines[0].get_marker() == "o" and tuple(drawn[1].get_xlim()) == (2, 4)
