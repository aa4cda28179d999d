"""Hooks of the run loop (progress bar, loggers, the Flower runner's bookkeeping)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedhet.experiment.runner import Experiment


class Callback:
    """Override what you need (all default to doing nothing)."""

    def on_row(self, exp: Experiment, row: dict) -> None:
        """A round's row is complete and not yet written: add keys to it."""

    def on_row_written(self, exp: Experiment, row: dict) -> None:
        """The row is in metrics.jsonl (progress bars, logs)."""

    def on_summary(self, exp: Experiment, summary: dict) -> None:
        """The summary is built and not yet written: add keys to it."""

    def on_finished(self, exp: Experiment, summary: dict) -> None:
        """summary.json and the plots are written (loggers upload them and close)."""
