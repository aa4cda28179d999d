"""``fedhet sweep``: a set of experiments run as a persistent queue in parallel lanes.

A sweep file (YAML) names the runs::

    name: fedacd_fmnist                 # also the default output folder: runs/<name>
    out: runs/fedacd_fmnist_p0.1_r20    # optional
    lanes: 2                            # processes side by side; each run gets usable CPUs // lanes threads
                                        # (or the command line's --set run.threads=N)
    seeds: [0]                          # default seeds of every run
    set: [data.pool_fraction=0.1, train.rounds=20]    # overrides of every run
    grid: {algorithm.params.margin_weight: [0.5, 1.0]}   # optional: every run once per combination
    metric: global_acc                  # optional: the table's and the verdicts' metric, one a summary holds
                                        # (global_acc, global_labeldist_acc, global_val_acc, personal_acc,
                                        # personal_acc_pooled; default: each run's headline)
    paired: b0.1_fedavg                 # optional: per-seed differences against this tag's runs (same data only;
                                        # a list, one baseline a split, pairs each run with the one on its data)
    verdicts: [...]                     # optional: claims decided from the completed runs (fedhet.experiment.verdict)
    runs:
      - config: configs/papers/fedacd/fmnist_b0.1_fedavg.yaml
        tag: b0.1_fedavg                # default: the config's file name without .yaml
      - {config: configs/papers/fedacd/fmnist_b0.1_fedacd.yaml, seeds: [0, 1], set: [eval.every=2]}
      - {config: configs/papers/fedacd/fmnist_b0.1_fedacd_base.yaml, costs_like: fmnist_b0.1_fedacd}
                                        # costs_like: a tag whose completed runs (at the same grid point,
                                        # filtered by these runs' own engine, threads and CPU) say how
                                        # long these take while none of their own has completed (for
                                        # --list and --skip-runs-that-cannot-finish)

Each (run, grid point, seed) is one job with its own run directory ``<out>/<tag>[_<grid>]_s<seed>``
and config name ``<tag>[_<grid>]`` (so ``fedhet compare`` pools its seeds; a name, tag or grid
value holds no slash, and a name or tag starts with no dot). The queue is the
sweep file plus the run directories: a job whose ``summary.json`` says ``completed`` is skipped, one
with a checkpoint is resumed (``fedhet run --resume``), the others start fresh. So a killed sweep
continues where it stopped when started again, and no completed run is ever re-run. A config
of a run the sweep would start that does not load (an unknown key, a value out of range) stops the
sweep before any run starts (``--list`` marks it). A job that fails while it runs (a method
parameter it does not take, a diverged run) is reported, marked ``<out>/<run>.failed`` with its
config and its log's tail, and the others go on; ``--retry-failed`` runs the failed ones again.
A failure before the run wrote its folder holds the job back only while the sweep asks for that
config (how the run is carried out aside); a failed run's folder is compared like any other
(stale under another config). Each job's output is
in ``<out>/<run>.log``. A run directory whose recorded config differs from what the sweep file now
asks for (an edited ``set``, say) is ``stale``: reported and left alone, never mixed into a group
(a method's parameters are compared with their defaults filled in: a default stated is no change).
A folder whose metrics.jsonl holds every round but whose summary.json is lost or unreadable, with
no checkpoint to finish from (a committed run after a bad merge), is ``damaged``: reported and left
alone rather than run again from round 1 over the rounds it holds.
A completed run with fewer rounds than the sweep now asks for (a raised ``train.rounds``) is
``extend``: its recorded config gets the new round count and the run continues from its last
checkpoint. (An interrupted run is resumed with the new count as well.) The extended run equals
one made at the new length from the start (``Experiment.resume``): an evaluation the old last
round had only as the last stays in its row under ``evaluated_as_last_round``, outside the
summary; a method whose last round acted otherwise (FedFM-Lite's upload, ``model_every``) refuses
the extension, and the run fails with that reason. While a sweep runs a job, ``<out>/<run>.lock`` holds the run's process id; another
sweep over the same folder sees the job as ``running`` and leaves it alone (a lock whose process
is gone is ignored).
``--only TAG`` (repeatable) starts, resumes or retries just the runs of that tag (a run entry's tag,
or one grid group); the others are left as they are, the table still covers every completed run of
the sweep, and the exit status counts only the chosen runs. Two sweep processes with different
``--only`` over one folder share it safely (the locks above). ``--no-start-after SECONDS`` starts no
run once SECONDS have passed since the sweep started (the lanes' first runs always start): the runs
going on then finish and the rest wait for the next sweep, so a short compute window ends with its
runs instead of a run it cannot finish. ``--finish-by SECONDS`` is the window itself: at the limit,
runs still going on are stopped (each records its summary and keeps its checkpoint, so a sweep with
time resumes it) and no run starts. The progress lines of every sweep say when each running run
should end at its pace (:func:`seconds_left`, from the rounds it recorded in this sweep, at their
recent speed), and say when that is after the ``--finish-by`` limit, so a run that cannot end in time
shows it early. (They do not stop it early: a run's pace changes when a run
beside it ends or a slow evaluation comes, as in the committed 200-round runs of
benchmarks/runs/fedacd_fmnist_e5_r200, so a projection is a guide, not a verdict.)
``--skip-runs-that-cannot-finish`` (with ``--finish-by``) starts no run that would end after the
limit by the pace of the slowest of its tag's completed runs on a machine like this one
(:func:`expected_seconds`, :func:`like_runs`: the same CPU model, instruction sets and CPU count, as
many threads a run, recorded on the CPU), or, while its tag has none, of its run entry's
``costs_like`` tag (:func:`pace_runs`); the queue's next run that fits starts instead, and a run
with neither starts. It is for windows whose stopped runs cannot be resumed later (a machine that
starts fresh). ``--list`` shows the same estimate (:func:`expected_run_seconds`) beside each run the
sweep would start, and their total, to size a window before starting it.
Runs are resumed with the sweep's thread count: change ``lanes`` and a resumed run may differ from
an uninterrupted one in the last float bits. The sweep ends by writing ``<out>/sweep.md`` (the ``fedhet compare``
table of every group, then the outcome of each of the file's ``verdicts``) and ``sweep.png``;
``fedhet sweep FILE --table`` writes and prints them from the runs there are, starting none (while
a run is stale it only prints them, keeping the files as they were: a ``--set`` left out of the
command makes every run stale).
Run folders may be committed with their small files only (config, summary, metrics): a sweep
started in a fresh clone skips them as completed. ``--adopt FOLDER_OR_ARCHIVE`` copies a sweep's
completed runs made elsewhere (a lent GPU's archive, another machine's ``--out``) into its own
folder, only :data:`KEPT_FILES` of each.

Modules: ``spec`` (the sweep file read into jobs), ``state`` (a job's status and lock from its run
directory), ``pace`` (when a running run should end, how long one not started should take), ``lanes`` (running the jobs), ``table``
(``sweep.md``) and ``adopt`` (runs made elsewhere).
"""

from fedhet.experiment.sweep.adopt import adopt_runs
from fedhet.experiment.sweep.lanes import expected_run_seconds, lane_threads, resumable_sets, run_sweep, sweep_threads
from fedhet.experiment.sweep.pace import expected_seconds, rows_since, seconds_left
from fedhet.experiment.sweep.spec import Job, Sweep, load_sweep, select_jobs
from fedhet.experiment.sweep.state import (
    KEPT_FILES,
    config_mismatch,
    job_status,
    like_runs,
    lock_holder,
    pace_runs,
    resume_round,
)
from fedhet.experiment.sweep.table import write_report

__all__ = [
    "Job",
    "KEPT_FILES",
    "Sweep",
    "adopt_runs",
    "config_mismatch",
    "expected_run_seconds",
    "expected_seconds",
    "job_status",
    "lane_threads",
    "like_runs",
    "load_sweep",
    "lock_holder",
    "pace_runs",
    "resumable_sets",
    "resume_round",
    "rows_since",
    "run_sweep",
    "seconds_left",
    "select_jobs",
    "sweep_threads",
    "write_report",
]
