"""Tables over run directories: ``fedhet compare`` and the table printed after ``fedhet run``; mean ± std
over seeds; and what the per-paper table scripts (``benchmarks/*_table.py``) share.

Modules: ``stats`` (a metric over seeds), ``runs`` (run directories read, checked and grouped as seeds
of experiments), ``paired`` (per-seed differences against a baseline on the same data), ``table``
(the compare table, and ``compare``) and ``result_files`` (the table scripts' shared pieces).
"""

from fedhet.experiment.report.paired import paired_differences
from fedhet.experiment.report.result_files import (
    provenance_lines,
    read_run_folder,
    run_table_script,
    unfinished_lines,
    write_result_files,
)
from fedhet.experiment.report.runs import group_runs, load_paper, load_summary
from fedhet.experiment.report.stats import format_mean_std, format_value, mean_std
from fedhet.experiment.report.table import compare, compare_table

__all__ = [
    "compare",
    "compare_table",
    "format_mean_std",
    "format_value",
    "group_runs",
    "load_paper",
    "load_summary",
    "mean_std",
    "paired_differences",
    "provenance_lines",
    "read_run_folder",
    "run_table_script",
    "unfinished_lines",
    "write_result_files",
]
