"""Hooks of the run loop (progress bar, loggers, the Flower runner's bookkeeping).

A callback sees the run through :class:`RunView`, the few attributes it reads from it, not
through :class:`fedhet.experiment.runner.Experiment`: the runner imports this module and
:mod:`fedhet.experiment.loggers`, never the other way (an import-linter contract in
pyproject.toml holds it so). An ``Experiment`` is a ``RunView``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from fedhet.algorithms.base import Algorithm
    from fedhet.experiment.config import ExperimentConfig


class RunView(Protocol):
    """What callbacks and loggers read from the run that calls them."""

    @property
    def cfg(self) -> ExperimentConfig:
        """The run's resolved config."""

    @property
    def run_dir(self) -> Path:
        """The run directory."""

    @property
    def start_round(self) -> int:
        """Rounds already done when this process took the run up (0, or the resumed checkpoint's)."""

    @property
    def algorithm(self) -> Algorithm:
        """The run's algorithm (loggers read its ``name``)."""

    @property
    def metric(self) -> str:
        """The headline metric's key in a row."""


class Callback:
    """Override what you need (all default to doing nothing)."""

    def on_row(self, exp: RunView, row: dict) -> None:
        """A round's row is complete and not yet written: add keys to it."""

    def on_row_written(self, exp: RunView, row: dict) -> None:
        """The row is in metrics.jsonl (progress bars, logs)."""

    def on_summary(self, exp: RunView, summary: dict) -> None:
        """The summary is built and not yet written: add keys to it."""

    def on_finished(self, exp: RunView, summary: dict) -> None:
        """summary.json and the plots are written (loggers upload them and close)."""
