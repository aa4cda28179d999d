"""fedhet sweep: a persistent queue of runs in parallel lanes."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from helpers import run_killed_in_round, write_sweep

import fedhet.experiment.sweep.lanes as sweep_lanes
from fedhet.cli import main as cli_main
from fedhet.core.errors import CheckpointError, ConfigError
from fedhet.experiment.config import load_config
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.runner import Experiment
from fedhet.experiment.summary import cpu_identity
from fedhet.experiment.sweep import (
    config_mismatch,
    expected_seconds,
    job_status,
    lane_threads,
    like_runs,
    load_sweep,
    pace_runs,
    resumable_sets,
    resume_round,
    rows_since,
    run_sweep,
    seconds_left,
    sweep_threads,
    write_report,
)
from fedhet.experiment.sweep.pace import duration
from fedhet.experiment.sweep.state import failure_marker


def rows_without_time(run_dir):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(run_dir)]


def test_sweep_expands_runs_grid_and_seeds(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0, 1]}), ("fedprox", {"tag": "prox"})],
                       grid={"train.lr": [0.05, 0.1]}, set=["train.rounds=2"])
    sweep = load_sweep(path)
    names = sorted(j.name for j in sweep.jobs)
    assert names == ["fedavg_lr0.05_s0", "fedavg_lr0.05_s1", "fedavg_lr0.1_s0", "fedavg_lr0.1_s1",
                     "prox_lr0.05_s0", "prox_lr0.1_s0"]
    job = next(j for j in sweep.jobs if j.name == "prox_lr0.1_s0")
    assert job.overrides == ["train.rounds=2", "train.lr=0.1", "seed=0", "name=prox_lr0.1"]
    assert all(job_status(j) == "new" for j in sweep.jobs)


def test_the_table_of_a_sweep_not_yet_run_says_so_and_lists_its_runs(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], verdicts=[
        {"claim": "FedProx > FedAvg", "rule": "every_seed", "better": "fedprox", "than": "fedavg", "seeds": [0]}])
    assert cli_main(["sweep", str(path), "--table"]) == 0
    out = capsys.readouterr().out
    assert "No completed runs yet." in out
    assert "| FedProx > FedAvg | every_seed, seeds [0] |" in out and "**pending**" in out
    assert "- `fedavg_s0`: new" in out and "- `fedprox_s0`: new" in out
    assert (tmp_path / "out" / "sweep.md").read_text().strip() == out.strip()


def test_the_command_lines_run_threads_sets_each_runs_threads(tmp_path, small_config, monkeypatch, capsys):
    # two sweeps side by side on one machine: each lane's share of the CPUs would oversubscribe it
    monkeypatch.setattr("fedhet.experiment.sweep.lanes.usable_cpus", lambda: 4)
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], lanes=1, set=["train.rounds=1"])
    assert cli_main(["sweep", str(path), "--set", "run.threads=1"]) == 0
    assert "1 lane(s) of 1 thread(s)" in capsys.readouterr().err
    recorded = yaml.safe_load((tmp_path / "out" / "fedavg_s0" / "config.yaml").read_text())
    assert recorded["run"]["threads"] == 1
    for wrong in ("0", "two", "true", "1.5"):
        with pytest.raises(ConfigError, match="at least 1"):
            run_sweep(load_sweep(path, out=tmp_path / "untouched", extra_set=[f"run.threads={wrong}"]), log=lambda m: None)
        assert not (tmp_path / "untouched").exists()      # refused before the sweep makes its folder


def test_a_sweep_file_may_not_set_run_threads(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"set": ["run.threads=1"]})])
    with pytest.raises(ConfigError, match="fedhet sweep FILE --set run.threads=N"):
        load_sweep(path)


def test_command_line_set_applies_to_every_run_after_the_files_sets(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"set": ["train.rounds=3"]}), ("fedprox", {})],
                       set=["train.rounds=2"])
    assert cli_main(["sweep", str(path), "--list", "--set", "train.rounds=1", "--set", "eval.every=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        tail = line.split(".yaml ", 1)[1]
        assert tail.index("train.rounds=2") < tail.index("train.rounds=1 eval.every=1") < tail.index("seed=0")
    assert cli_main(["sweep", str(path), "--set", "train.rounds=1"]) == 0
    sweep = load_sweep(path, extra_set=["train.rounds=1"])
    for job in sweep.jobs:
        assert len(read_metrics(job.run_dir)) == 1      # the command line's value won over both files' sets
    assert "fedhet sweep " + str(path) + " --set train.rounds=1" in (sweep.out / "sweep.md").read_text()
    elsewhere = load_sweep(path, out=tmp_path / "elsewhere", extra_set=["train.rounds=1"])
    assert f"fedhet sweep {path} --out {tmp_path / 'elsewhere'} --set train.rounds=1" in write_report(elsewhere)
    # a typo in a --set over the completed runs is a config error: no run is called stale, the
    # table stays, nothing is advised deleted (every mode: run, --list, --table)
    table = (sweep.out / "sweep.md").read_text()
    capsys.readouterr()
    for mode in ([], ["--list"], ["--table"]):
        assert cli_main(["sweep", str(path), *mode, "--set", "train.rounds=1", "--set", "trian.lr=0.1"]) == 2
        err = capsys.readouterr().err
        assert "2 run(s) of the sweep have a config that does not load (fedavg_s0, fedprox_s0): fix the sweep " \
               "file or the --set values" in err and "did you mean train?" in err and "delete" not in err, err
    assert (sweep.out / "sweep.md").read_text() == table
    assert all(job_status(j) == "completed" for j in sweep.jobs)
    # A resumed run takes the --set values of how it is carried out (not run.threads: the sweep's own),
    # so a run stopped on a GPU may go on on the CPU; other settings make a recorded run stale
    job = sweep.jobs[0]
    assert resumable_sets(["run.engine=auto", "train.lr=0.3", "run.threads=7", "run.device=cpu",
                           "run.out_dir=/elsewhere"]) == ["run.engine=auto", "run.device=cpu"]   # a resume refuses out_dir
    assert config_mismatch(job) == [] and load_sweep(path, extra_set=["run.device=cuda"]).jobs[0].run_dir == job.run_dir
    assert job_status(load_sweep(path, extra_set=["train.rounds=1", "run.device=cuda"]).jobs[0]) == "completed"
    assert job_status(load_sweep(path, extra_set=["train.rounds=1", "run.precision=bf16"]).jobs[0]) == "stale"


def test_a_resumed_run_takes_the_set_values_of_how_it_is_carried_out(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=1"])
    assert cli_main(["sweep", str(path)]) == 0
    # more rounds: the completed run is extended through --resume, on the engine asked for now
    assert cli_main(["sweep", str(path), "--set", "train.rounds=2", "--set", "run.engine=reference"]) == 0
    run_dir = load_sweep(path).jobs[0].run_dir
    assert len(read_metrics(run_dir)) == 2
    assert json.loads((run_dir / "summary.json").read_text())["engine"]["engine"] == "reference"
    assert load_config(run_dir / "config.yaml").run.engine == "reference"     # recorded from then on


def test_sweep_file_errors_are_clear(tmp_path, small_config, monkeypatch):
    monkeypatch.chdir(tmp_path)                  # a run's config path is relative to the working directory
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(small_config))
    bad = tmp_path / "bad.yaml"
    bad.write_text("runs: [a.yaml, nothere.yaml]\n")
    with pytest.raises(ConfigError, match=r"runs\[1\]: config nothere.yaml does not exist \(working directory"):
        load_sweep(bad)
    # run from another folder: the one the paths start from (here the sweep file's) is named
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    bad.write_text("runs: [a.yaml]\n")
    with pytest.raises(ConfigError, match=f"config a.yaml does not exist .*run fedhet sweep from {tmp_path}, where "
                                          "the path is"):
        load_sweep(bad)
    monkeypatch.chdir(tmp_path)
    bad.write_text("name: x\nruns: []\n")
    with pytest.raises(ConfigError, match="non-empty 'runs'"):
        load_sweep(bad)
    bad.write_text("runs: [{config: a.yaml, seed: 3}]\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_sweep(bad)
    bad.write_text("runs: [a.yaml, a.yaml]\n")
    with pytest.raises(ConfigError, match="different tags"):
        load_sweep(bad)
    bad.write_text("runs: [{config: [a.yaml]}]\n")
    with pytest.raises(ConfigError, match=r"runs\[0\] needs a 'config': a path, .*, got \['a.yaml'\]"):
        load_sweep(bad)
    (tmp_path / "afile").write_text("")
    bad.write_text("out: afile\nruns: [a.yaml]\n")
    with pytest.raises(ConfigError, match="bad.yaml: out afile is a file: name a folder"):
        load_sweep(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_sweep(tmp_path / "missing.yaml")
    for lanes in ("null", "two", "0", "2.5", "true"):
        bad.write_text(f"lanes: {lanes}\nruns: [a.yaml]\n")
        with pytest.raises(ConfigError, match="lanes must be a whole number of at least 1"):
            load_sweep(bad)
    bad.write_text("lanes: 2\nruns: [a.yaml]\n")
    with pytest.raises(ConfigError, match="--lanes must be a whole number of at least 1, got 0"):
        load_sweep(bad, lanes=0)                       # the value given, named where it came from
    bad.write_text("seeds: [0, 1, 0]\nruns: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"seeds \[0, 1, 0\] list seed\(s\) \[0\] more than once"):
        load_sweep(bad)
    for name in ("w/../..", "..", ".hidden", "a\\\\b"):
        bad.write_text(f"name: '{name}'\nruns: [a.yaml]\n")
        with pytest.raises(ConfigError, match="bad.yaml: name .* names a folder, so it may not hold a slash, be "
                                              "empty or start with a dot"):
            load_sweep(bad)
        bad.write_text(f"runs: [{{config: a.yaml, tag: '{name}'}}]\n")
        with pytest.raises(ConfigError, match=r"runs\[0\]: tag .* names a folder"):
            load_sweep(bad)
    bad.write_text("grid: {train.lr: [0.1, x/y]}\nruns: [a.yaml]\n")
    with pytest.raises(ConfigError, match="sweep grid: 'train.lr': value 'x/y' is part of its runs' folder names, "
                                          "so it may not hold a slash"):
        load_sweep(bad)
    for metric in ("3", "[global_acc]", "''", "global_ac"):        # the table reads the summaries' metrics
        bad.write_text(f"metric: {metric}\nruns: [a.yaml]\n")
        with pytest.raises(ConfigError, match="metric .* is not one a run's summary holds; one of: global_acc, "):
            load_sweep(bad)
    for seeds in ("[abc]", "[1.5]", "[true]"):
        bad.write_text(f"seeds: {seeds}\nruns: [a.yaml]\n")
        with pytest.raises(ConfigError, match="seeds must be whole numbers"):
            load_sweep(bad)
        bad.write_text(f"runs: [{{config: a.yaml, seeds: {seeds}}}]\n")
        with pytest.raises(ConfigError, match=r"runs\[0\]: seeds must be whole numbers"):
            load_sweep(bad)


def test_only_runs_the_named_tags_and_the_table_shows_every_completed_run(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {"seeds": [0, 1]}),
                                                ("fedavg", {"tag": "broken", "set": ["algorithm.params.nope=1"]})],
                       set=["train.rounds=1"])
    assert cli_main(["sweep", str(path), "--only", "fedpac"]) == 2
    assert "--only fedpac: no run of sweep 'tiny' has this tag; its tags and groups: broken, fedavg, fedprox" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert cli_main(["sweep", str(path), "--only", "fedprox", "--list"]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == [
        str(tmp_path / "out" / "fedprox_s0"), str(tmp_path / "out" / "fedprox_s1")]
    assert cli_main(["sweep", str(path), "--only", "broken"]) == 1
    capsys.readouterr()
    # another tag's failed run neither runs again nor sets the exit status of an --only sweep
    assert cli_main(["sweep", str(path), "--only", "fedprox", "--only", "fedprox"]) == 0
    assert "2 runs (--only fedprox: 2 of 4), none left alone, 2 to run" in capsys.readouterr().err
    sweep = load_sweep(path)
    assert {j.name: job_status(j) for j in sweep.jobs} == {
        "fedavg_s0": "new", "fedprox_s0": "completed", "fedprox_s1": "completed", "broken_s0": "failed"}
    # the table of an --only sweep shows the other tags' runs too (this one starts nothing: its run failed)
    (sweep.out / "sweep.md").unlink()
    assert cli_main(["sweep", str(path), "--only", "broken"]) == 1
    table = (sweep.out / "sweep.md").read_text()
    assert "| fedprox | fedprox |" in table and "`broken_s0`: failed" in table and "`fedavg_s0`: new" in table
    assert not list(sweep.out.glob(".sweep.md.*"))


def test_only_takes_a_run_entrys_tag_or_one_of_its_grid_groups(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], grid={"train.lr": [0.05, 0.1]})
    for only, expected in ((["fedprox"], ["fedprox_lr0.05_s0", "fedprox_lr0.1_s0"]),
                           (["fedavg_lr0.1"], ["fedavg_lr0.1_s0"]),
                           (["fedavg_lr0.1", "fedprox"], ["fedavg_lr0.1_s0", "fedprox_lr0.05_s0", "fedprox_lr0.1_s0"])):
        assert cli_main(["sweep", str(path), "--list", *(a for name in only for a in ("--only", name))]) == 0
        assert [line.split()[1].rsplit("/", 1)[1] for line in capsys.readouterr().out.splitlines()] == expected


def test_no_start_after_lets_the_lanes_first_runs_finish_and_starts_no_other(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0, 1]})], lanes=1, set=["train.rounds=1"])
    for bad in ("-1", "nan", "inf"):
        assert cli_main(["sweep", str(path), "--no-start-after", bad]) == 2
        assert f"--no-start-after must be 0 or more seconds, got {bad}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    messages = []
    outcome = run_sweep(load_sweep(path), no_start_after=0, log=messages.append, poll_seconds=0.2)
    assert outcome == {"fedavg_s0": "completed"}
    assert any("(--no-start-after): 1 run(s) not started: fedavg_s1" in m for m in messages), messages
    assert {j.name: job_status(j) for j in load_sweep(path).jobs} == {"fedavg_s0": "completed", "fedavg_s1": "new"}
    # a limit the sweep does not reach changes nothing: the next sweep runs the rest
    assert run_sweep(load_sweep(path), no_start_after=3600, log=messages.append, poll_seconds=0.2) == {
        "fedavg_s1": "completed"}


def timed_row(rnd, total, evaluate=0.0):
    return {"round": rnd, "seconds": {"train": total - evaluate, "evaluate": evaluate, "total": total}}


def test_seconds_left_counts_the_rounds_and_the_evaluations_left_at_the_recorded_pace():
    rows = [timed_row(1, 3.0), timed_row(2, 10.0, evaluate=8.0)]           # eval.every 2: round 2 evaluated
    # rounds 3-6 at (3 + 2) / 2 = 2.5 s without evaluation, evaluations at rounds 4 and 6 at 8 s
    assert seconds_left(rows, 2, 6, 2) == pytest.approx(4 * 2.5 + 2 * 8.0)
    # the last round is evaluated whatever eval.every says: rounds 3-5, evaluations at 4 and 5
    assert seconds_left(rows, 2, 5, 2) == pytest.approx(3 * 2.5 + 2 * 8.0)
    # one slow evaluation counts once, not once for every evaluation left (median)
    slow = rows + [timed_row(3, 2.0), timed_row(4, 102.0, evaluate=100.0), timed_row(5, 2.0), timed_row(6, 10.0, 8.0)]
    assert seconds_left(slow, 6, 10, 2) == pytest.approx(4 * (3 + 5 * 2.0) / 6 + 2 * 8.0)
    assert seconds_left(rows, 6, 6, 2) == 0
    assert seconds_left([timed_row(1, 3.0)], 1, 6, 2) is None        # evaluations left, none seen yet
    assert seconds_left([], 0, 6, 2) is None and seconds_left([{"round": 1}], 1, 6, 2) is None


def test_seconds_left_goes_by_the_recent_speed_and_the_mean_round_size():
    def row(rnd, samples, train, evaluate=0.0):
        return {**timed_row(rnd, train + evaluate, evaluate), "samples": samples}

    # 12 rounds of 100 or 300 sample-steps (mean 200): rounds 1-2 at 100 sample-steps a second, the
    # last 10 (RECENT_ROUNDS) at 50; round 12 evaluated in 5 s
    sizes = [100, 300] * 6
    rows = [row(i + 1, n, n / (100 if i < 2 else 50), 5.0 if i == 11 else 0.0) for i, n in enumerate(sizes)]
    # rounds 13-20 left: 200 sample-steps each at 50 a second, and the last round's evaluation
    assert seconds_left(rows, 12, 20, 100) == pytest.approx(8 * 200 / 50 + 5.0)
    # one speed throughout, the last 10 rounds smaller (180 sample-steps on average) than the run's
    # (200): small recent rounds are not taken for a faster machine
    small_last = [row(i + 1, 300 if i < 6 else 100, (300 if i < 6 else 100) / 50) for i in range(12)]
    small_last[-1] = row(12, 100, 2.0, 5.0)
    assert seconds_left(small_last, 12, 20, 100) == pytest.approx(8 * 200 / 50 + 5.0)
    # a row without its sample-steps: the last 10 rounds' mean seconds
    rows[0] = timed_row(1, 1.0)
    assert seconds_left(rows, 12, 20, 100) == pytest.approx(8 * sum(n / 50 for n in sizes[2:]) / 10 + 5.0)


def test_rows_since_skips_what_a_resumed_run_records_again():
    before = [timed_row(1, 1.0), timed_row(2, 1.0), timed_row(3, 1.0)]
    # resumed from its round-1 checkpoint: round 1 kept, rounds 2-3 recorded again with their own times
    assert rows_since(before, [before[0], timed_row(2, 1.5), timed_row(3, 1.5)]) == [timed_row(2, 1.5),
                                                                                     timed_row(3, 1.5)]
    assert rows_since(before, before + [timed_row(4, 2.0)]) == [timed_row(4, 2.0)]
    assert rows_since([], before) == before and rows_since(before, before[:2]) == []


class ClockThatJumpsToTheLimit:
    """The ``time`` of the sweep's lanes (fedhet.experiment.sweep.lanes), with ``monotonic`` jumping
    ``seconds`` ahead once ``ready()`` holds: the limit arrives right after what the test needs has
    happened, at whatever pace this machine runs (a fixed wall-clock limit stopped the short run too
    on a loaded machine)."""

    def __init__(self, real, seconds, ready):
        self.real, self.seconds, self.ready, self.jumped = real, seconds, ready, False

    def monotonic(self):
        if not self.jumped and self.ready():
            self.jumped = True
        return self.real.monotonic() + (self.seconds if self.jumped else 0.0)

    def __getattr__(self, name):        # sleep, strftime, localtime, time: the real ones
        return getattr(self.real, name)


def test_finish_by_stops_a_run_at_the_limit_lets_one_that_fits_finish_and_progress_says_when_runs_end(
        tmp_path, small_config, capsys, monkeypatch):
    # lane 1: 100,000 rounds, far more than the limit at any pace; lane 2: a 2-round run
    path = write_sweep(tmp_path, small_config, [("fedavg", {"tag": "long", "set": ["train.rounds=100000"]}),
                                                ("fedprox", {"set": ["train.rounds=2"]})], lanes=2)
    for bad in ("0", "-5", "nan", "inf"):
        assert cli_main(["sweep", str(path), "--finish-by", bad]) == 2
        assert f"--finish-by must be a positive number of seconds, got {bad}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

    out = tmp_path / "out"

    def short_run_done_and_long_one_paced():
        summary = out / "fedprox_s0" / "summary.json"
        return (summary.is_file() and json.loads(summary.read_text()).get("status") == "completed"
                and (out / "long_s0" / "metrics.jsonl").is_file() and len(read_metrics(out / "long_s0")) >= 3)

    limit = 1000
    monkeypatch.setattr(sweep_lanes, "time", ClockThatJumpsToTheLimit(sweep_lanes.time, limit,
                                                                        short_run_done_and_long_one_paced))
    messages = []
    outcome = run_sweep(load_sweep(path), finish_by=limit, report_every=0.05, log=messages.append,
                        poll_seconds=0.1)
    assert outcome == {"long_s0": "stopped", "fedprox_s0": "completed"}, messages
    stop = next(m for m in messages if "stop   long_s0" in m)
    assert f"{limit} s have passed (--finish-by)" in stop, stop
    recorded = len(read_metrics(out / "long_s0"))
    assert 3 <= recorded < 100000
    assert job_status(next(j for j in load_sweep(path).jobs if j.name == "long_s0")) == "interrupted"
    # the run itself got the signal: it recorded its stop (a run never signalled would still be running)
    assert json.loads((out / "long_s0" / "summary.json").read_text())["status"] == "interrupted"
    # the progress lines said when it would end, at the pace of its rounds so far
    # (each line names every running run: only long_s0's own part of a line is checked, since the short run's
    # "ends about" may stand beside long_s0's first round, which has no pace yet)
    long_parts = [part for m in messages for part in re.findall(r"long_s0 \(round [^)]*\)", m)]
    late = [part for part in long_parts if "ends about" in part]
    assert late and all("of 100000, ends about" in part for part in late), long_parts
    assert all(", after the --finish-by limit at " in part for part in late), late


def test_finish_by_stops_every_run_at_the_limit_and_starts_none_after_it(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0, 1, 2]})], lanes=2,
                       set=["train.rounds=3000"])
    assert cli_main(["sweep", str(path), "--finish-by", "1"]) == 0      # stopped runs are no failure
    err = capsys.readouterr().err
    assert "stop   fedavg_s0 at round" in err and "stop   fedavg_s1 at round" in err, err
    assert "1 s have passed (--finish-by)" in err
    assert "1 run(s) not started: fedavg_s2" in err
    assert "2 run(s) stopped by --finish-by: fedavg_s0, fedavg_s1 (whatever they recorded stays in their folders" in err
    assert {j.name: job_status(j) for j in load_sweep(path).jobs}["fedavg_s2"] == "new"


def test_expected_seconds_is_the_slowest_like_runs_mean_round_times_the_rounds_left():
    like = [[timed_row(1, 1.0), timed_row(2, 3.0)],                      # 2 s a round
            [timed_row(1, 10.0)],                                         # 10 s
            [timed_row(1, 4.0), timed_row(2, 4.0), timed_row(3, 4.0)]]   # 4 s (another length: per round)
    assert expected_seconds(like, 0, 10) == pytest.approx(10 * 10.0)
    assert expected_seconds(like, 3, 10) == pytest.approx(7 * 10.0)      # a resumed run: rounds 4-10 left
    uneven = [[timed_row(1, 1.0), timed_row(2, 5.0)], like[2]]          # 3 s a round, with a 5 s round
    assert expected_seconds(uneven, 0, 10) == pytest.approx(10 * 4.0)     # a mean a run, not its slowest round
    assert expected_seconds(like, 10, 10) == 0
    # a run whose rounds are not all timed says nothing; without a like run there is no guess
    assert expected_seconds([[timed_row(1, 1.0), {"round": 2}]], 0, 10) is None
    assert expected_seconds([], 0, 10) is None


def fake_completed_run(run_dir, seconds_a_round, rounds, cpu, threads, **summary):
    """A run folder that a sweep reads as completed (unless ``summary`` says otherwise): its metrics
    rows of ``seconds_a_round`` each and a summary of a run on the CPU ``cpu`` in one session."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(timed_row(r, seconds_a_round)) + "\n"
                                                   for r in range(1, rounds + 1)))
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "completed", "rounds_completed": rounds, "device": "cpu", "engine": {"engine": "reference"},
        "memory_format": "contiguous", "wall_seconds_this_session": seconds_a_round * rounds + 5.0,
        "machine": {**cpu, "torch_threads": threads}, **summary}))


def test_like_runs_are_the_tags_completed_runs_on_a_machine_like_this_one(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": list(range(10))}), ("fedprox", {})])
    jobs = load_sweep(path).jobs
    run_dir = {j.name: j.run_dir for j in jobs}
    here = {"cpu_model": "Xeon", "cpu_isa": "AVX512, bf16, amx; family 6 model 207", "cpus": 2}
    fake_completed_run(run_dir["fedavg_s1"], 5.0, 3, here, threads=1)                       # like
    fake_completed_run(run_dir["fedavg_s2"], 7.0, 3, {**here, "cpu_isa": "AVX2; family 25 model 1"}, 1)
    fake_completed_run(run_dir["fedavg_s3"], 7.0, 3, {**here, "cpu_model": "AMD EPYC"}, 1)
    fake_completed_run(run_dir["fedavg_s4"], 7.0, 3, {**here, "cpus": 16}, 1)
    fake_completed_run(run_dir["fedavg_s5"], 7.0, 3, here, threads=2)
    fake_completed_run(run_dir["fedavg_s6"], 7.0, 3, here, threads=1, device="cuda")
    fake_completed_run(run_dir["fedavg_s7"], 7.0, 3, here, threads=1, status="interrupted")
    # resumed: its last session (on this CPU) took 8 s of its 21 s of rounds; the rest ran elsewhere
    fake_completed_run(run_dir["fedavg_s8"], 7.0, 3, here, threads=1, wall_seconds_this_session=8.0)
    fake_completed_run(run_dir["fedprox_s0"], 7.0, 3, here, threads=1)                      # another tag
    fake_completed_run(run_dir["fedavg_s9"], 7.0, 3, here, threads=1)                       # a round untimed
    rows = read_metrics(run_dir["fedavg_s9"])
    (run_dir["fedavg_s9"] / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "seconds" or r["round"] != 2}) + "\n" for r in rows))
    jobs_by_name = {j.name: j for j in jobs}
    found = like_runs(jobs_by_name["fedavg_s0"], jobs, here, threads=1)
    assert [[r["seconds"]["total"] for r in rows] for rows in found] == [[5.0, 5.0, 5.0]]
    assert like_runs(jobs_by_name["fedavg_s1"], jobs, here, threads=1) == []       # not itself
    # a run that asks for an engine or a memory format counts only the runs made with it
    asking = {j.name: j for j in load_sweep(path, extra_set=["run.engine=parallel"]).jobs}
    assert like_runs(asking["fedavg_s0"], jobs, here, threads=1) == []
    asking = {j.name: j for j in load_sweep(path, extra_set=["run.memory_format=contiguous"]).jobs}
    assert len(like_runs(asking["fedavg_s0"], jobs, here, threads=1)) == 1
    asking = {j.name: j for j in load_sweep(path, extra_set=["run.memory_format=channels_last"]).jobs}
    assert like_runs(asking["fedavg_s0"], jobs, here, threads=1) == []
    # a run that will train on a GPU has no CPU run to go by
    asking = {j.name: j for j in load_sweep(path, extra_set=["run.device=cuda"]).jobs}
    assert like_runs(asking["fedavg_s0"], jobs, here, threads=1) == []


def test_list_says_how_long_each_run_the_sweep_would_start_should_take_here(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0, 1, 2, 3]}), ("fedprox", {})],
                       set=["train.rounds=3"])
    jobs = {j.name: j for j in load_sweep(path).jobs}
    here = cpu_identity()
    fake_completed_run(jobs["fedavg_s1"].run_dir, 1000.0, 3, here, threads=lane_threads(2))
    fake_completed_run(jobs["fedavg_s2"].run_dir, 1820.7, 3, here, threads=lane_threads(2))     # the slowest
    failure_marker(jobs["fedavg_s3"]).parent.mkdir(parents=True, exist_ok=True)
    failure_marker(jobs["fedavg_s3"]).write_text("exit status 1\n")
    assert cli_main(["sweep", str(path), "--list"]) == 0
    captured = capsys.readouterr()
    lines = {line.split()[1].rsplit("/", 1)[1]: line for line in captured.out.splitlines()}
    assert lines["fedavg_s0"].endswith("  [about 1 h 31 min here: the slowest of 2 like run(s)]")     # 3 x 1,820.7 s
    assert lines["fedavg_s1"].startswith("completed ") and "about" not in lines["fedavg_s1"]
    assert lines["fedavg_s3"].startswith("failed ") and "about" not in lines["fedavg_s3"]   # not started again
    assert lines["fedprox_s0"].startswith("new ") and "about" not in lines["fedprox_s0"]    # no run of its tag
    like = f"on a machine like this one ({lane_threads(2)} thread(s) a run, on the CPU)"
    # one run cannot be split between the lanes: they take at least the longest
    assert (f"2 run(s) to run; 1 with completed runs of their tag (or costs_like) {like}: about 1 h 31 min of runs, in 2 lane(s) "
            "at least 1 h 31 min (the others: no estimate)" in captured.err)
    assert cli_main(["sweep", str(path), "--list", "--retry-failed"]) == 0
    captured = capsys.readouterr()
    assert "fedavg_s3  <- " in captured.out and captured.out.count("[about 1 h 31 min here") == 2
    assert "3 run(s) to run; 2 with completed runs of their tag (or costs_like)" in captured.err and "at least 1 h 31 min (" in captured.err
    assert cli_main(["sweep", str(path), "--list", "--retry-failed", "--only", "fedavg"]) == 0
    assert "about 3 h 2 min of runs, in 2 lane(s) at least 1 h 31 min\n" in capsys.readouterr().err   # all estimated
    # runs of another thread count are no guide
    assert cli_main(["sweep", str(path), "--list", "--set", f"run.threads={lane_threads(2) + 1}"]) == 0
    captured = capsys.readouterr()
    assert "about" not in captured.out and "2 run(s) to run; no completed run of their tags (or costs_like) timed" in captured.err


def test_a_run_entrys_costs_like_tag_says_how_long_it_takes_until_its_own_runs_do(tmp_path, small_config, capsys):
    # fedprox (an ablation, say) costs what fedavg does: until a run of its own completes, --list and
    # --skip-runs-that-cannot-finish go by fedavg's
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0, 1]}),
                                                ("fedprox", {"seeds": [0, 1], "costs_like": "fedavg"})],
                       set=["train.rounds=3"])
    jobs = {j.name: j for j in load_sweep(path).jobs}
    here, threads = cpu_identity(), lane_threads(2)
    assert pace_runs(jobs["fedprox_s0"], list(jobs.values()), here, threads) == ("fedprox", [])     # none yet
    fake_completed_run(jobs["fedavg_s1"].run_dir, 1000.0, 3, here, threads=threads)
    tag, found = pace_runs(jobs["fedprox_s0"], list(jobs.values()), here, threads)
    assert tag == "fedavg" and [[r["seconds"]["total"] for r in rows] for rows in found] == [[1000.0] * 3]
    assert pace_runs(jobs["fedavg_s0"], list(jobs.values()), here, threads)[0] == "fedavg"   # its own tag
    assert cli_main(["sweep", str(path), "--list"]) == 0
    lines = {line.split()[1].rsplit("/", 1)[1]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["fedprox_s0"].endswith("  [about 50 min here: the slowest of 1 like run(s) of fedavg (costs_like)]")
    assert lines["fedavg_s0"].endswith("  [about 50 min here: the slowest of 1 like run(s)]")
    # --skip-runs-that-cannot-finish goes by them too, --only leaving fedavg's runs out of the queue
    messages: list[str] = []
    assert run_sweep(load_sweep(path), only=["fedprox"], finish_by=600, skip_unfinishable=True,
                     log=messages.append) == {"fedprox_s0": "not started", "fedprox_s1": "not started"}
    assert sum("it needs about 3000 s for rounds 1-3 at the pace of the slowest of 1 completed run(s) of fedavg "
               in m for m in messages) == 2, messages
    # once one of its own has completed, that goes
    fake_completed_run(jobs["fedprox_s1"].run_dir, 10.0, 3, here, threads=threads)
    assert pace_runs(jobs["fedprox_s0"], list(jobs.values()), here, threads)[0] == "fedprox"
    assert cli_main(["sweep", str(path), "--list"]) == 0
    assert "fedprox_s0  <- " in (out := capsys.readouterr().out) and "[about 30 s here: the slowest of 1 like run(s)]" in out
    # it names another run entry's tag
    for wrong in ("fedavgg", "fedprox"):
        bad = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {"costs_like": wrong})])
        with pytest.raises(ConfigError, match=rf"runs\[1\]: costs_like: '{wrong}' is not the tag of another run entry"):
            load_sweep(bad)
    # the runs of one tag go by one tag
    bad = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0]}), ("fedprox", {}),
                                               ("fedavg", {"seeds": [1], "costs_like": "fedprox"})])
    with pytest.raises(ConfigError, match=r"runs\[2\]: tag 'fedavg' is also used by .* 'costs_like'"):
        load_sweep(bad)


@pytest.mark.parametrize(("seconds", "said"), [(0, "0 s"), (99.4, "99 s"), (99.6, "2 min"), (100, "2 min"),
                                               (2460, "41 min"), (3575, "1 h 0 min"), (5462, "1 h 31 min")])
def test_duration_reads_as_one_plans_a_window(seconds, said):
    assert duration(seconds) == said


def test_resume_round_is_the_checkpoints_round_and_0_without_a_checkpoint(tmp_path, small_config, monkeypatch):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})],
                       set=["train.rounds=6", "run.checkpoint_every=2"])
    avg, prox = load_sweep(path).jobs
    assert resume_round(avg) == 0                                                # no folder yet
    # killed in its sixth round: 5 recorded, the checkpoint of round 4 is what a resume goes on from
    run_killed_in_round(Experiment.create(load_config(avg.config, avg.overrides), avg.run_dir), monkeypatch, 5)
    assert len(read_metrics(avg.run_dir)) == 5 and resume_round(avg) == 4
    (avg.run_dir / "checkpoint.pt").unlink()                                     # a committed folder
    assert resume_round(avg) == 0
    Experiment.create(load_config(prox.config, prox.overrides), prox.run_dir).run(progress=False)
    assert resume_round(prox) == 6                                               # completed: its end is saved


def test_skip_runs_that_cannot_finish_starts_only_the_runs_that_fit(tmp_path, small_config, capsys):
    # fedavg_s0 completed here at 1,000 s a round: its seeds 1 and 2 (3 rounds) cannot end in 600 s;
    # fedprox has no completed run to go by, so it starts
    path = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0, 1, 2]}), ("fedprox", {})], lanes=1,
                       set=["train.rounds=3"])
    assert cli_main(["sweep", str(path), "--skip-runs-that-cannot-finish"]) == 2
    assert "--skip-runs-that-cannot-finish needs --finish-by SECONDS" in capsys.readouterr().err
    sweep = load_sweep(path)
    # fedavg_s0 ran here as a sweep lane runs it; then its rounds are said to have taken 1,000 s each
    done = sweep.jobs[0]
    Experiment.create(load_config(done.config, [*done.overrides, f"run.threads={lane_threads(1)}"]),
                      done.run_dir).run(progress=False)
    rows = read_metrics(done.run_dir)
    (done.run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "seconds": {**r["seconds"], "total": 1000.0}}) + "\n" for r in rows))
    summary = json.loads((done.run_dir / "summary.json").read_text())
    (done.run_dir / "summary.json").write_text(json.dumps({**summary, "wall_seconds_this_session": 3005.0}))
    assert summary["machine"]["torch_threads"] == lane_threads(1)
    assert cli_main(["sweep", str(path), "--finish-by", "600", "--skip-runs-that-cannot-finish"]) == 0
    err = capsys.readouterr().err
    skipped = [m for m in err.splitlines() if "skip   fedavg_s" in m]
    assert len(skipped) == 2 and all("it needs about 3000 s for rounds 1-3 at the pace of the slowest of 1 "
                                     "completed run(s) of fedavg on a machine like this one" in m for m in skipped), err
    assert "2 run(s) not started by --skip-runs-that-cannot-finish: fedavg_s1, fedavg_s2" in err
    messages = []
    assert {j.name: job_status(j) for j in load_sweep(path).jobs} == {
        "fedavg_s0": "completed", "fedavg_s1": "new", "fedavg_s2": "new", "fedprox_s0": "completed"}
    # without the flag, the same limit starts them (and would stop them at it): the first here, the
    # other held back only by --no-start-after, which lets the one lane's first run start
    assert run_sweep(load_sweep(path), finish_by=3600, no_start_after=0, log=messages.append, poll_seconds=0.2) == {
        "fedavg_s1": "completed"}


def test_a_sweep_with_a_config_that_does_not_load_starts_no_run(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}),
                                                ("fedavg", {"tag": "broken", "set": ["train.rounds=-1"]})],
                       set=["train.rounds=1"])       # the run's own set comes after the file's: still -1
    assert cli_main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "1 run(s) of the sweep have a config that does not load (broken_s0): fix the sweep file or the --set " \
           "values; no run starts and no run folder or table is touched. broken_s0: invalid config" in err
    assert "train.rounds: Input should be greater than or equal to 1" in err
    assert not (tmp_path / "out").exists()
    assert cli_main(["sweep", str(path), "--list"]) == 2
    captured = capsys.readouterr()
    assert "broken_s0  <- " in captured.out and "[its config does not load: train.rounds: Input should be greater " \
        "than or equal to 1]" in captured.out
    assert captured.out.startswith("new ") and "\nunloadable  " in captured.out      # not "stale": no run is wrong
    assert "1 run(s) of the sweep have a config that does not load (broken_s0): fix the sweep file" in captured.err


def test_a_sweeps_runs_import_a_users_method_as_fedhet_run_does(tmp_path, small_config, monkeypatch):
    """A method module in the working directory but not on PYTHONPATH: `fedhet run` cannot import
    it, so neither can the runs a sweep starts (else such a run could not be resumed by hand)."""
    (tmp_path / "lab_here.py").write_text("from fedhet.algorithms.fedavg import FedAvg\n\n\n"
                                          "class Mine(FedAvg):\n    name = 'mine'\n")     # not on sys.path
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    path = write_sweep(tmp_path, small_config, [("fedavg", {"tag": "mine", "set": ["algorithm.name=lab_here:Mine"]})],
                       set=["train.rounds=1"])
    assert run_sweep(load_sweep(path), log=lambda m: None, poll_seconds=0.2) == {"mine_s0": "failed"}
    assert "no module 'lab_here' can be imported here" in (tmp_path / "out" / "mine_s0.failed").read_text()


def test_sweep_runs_everything_then_skips_completed_runs_and_reports_failures(tmp_path, small_config, capsys):
    # the second run has a parameter its method does not take, found when the run builds it: reported
    # as failed, the other completes
    path = write_sweep(tmp_path, small_config, [("fedavg", {}),
                                                ("fedavg", {"tag": "broken", "set": ["algorithm.params.nope=1"]})],
                       set=["train.rounds=1"])
    assert cli_main(["sweep", str(path)]) == 1
    captured = capsys.readouterr()
    assert "1 run(s) failed, stale or damaged: broken_s0" in captured.err
    sweep = load_sweep(path)
    status = {j.name: job_status(j) for j in sweep.jobs}
    assert status == {"fedavg_s0": "completed", "broken_s0": "failed"}
    assert "algorithm.params.nope: unknown parameter" in (sweep.out / "broken_s0.failed").read_text()
    table = (sweep.out / "sweep.md").read_text()
    assert "| fedavg | fedavg |" in table and "`broken_s0`: failed" in table
    assert (sweep.out / "sweep.png").is_file()

    # again: nothing is re-run (metrics untouched), the failed run is not retried without --retry-failed
    before = (sweep.jobs[0].run_dir / "metrics.jsonl").stat().st_mtime_ns
    messages = []
    outcome = run_sweep(load_sweep(path), log=messages.append, poll_seconds=0.2)
    assert outcome == {} and "2 runs, 1 completed, 1 failed (--retry-failed runs them again) left alone, 0 to run" \
        in messages[0]
    assert before == (sweep.jobs[0].run_dir / "metrics.jsonl").stat().st_mtime_ns
    # the failure is of that config, however the run is carried out (a GPU, other threads) ...
    assert job_status(load_sweep(path, extra_set=["run.device=cpu", "run.threads=1"]).jobs[1]) == "failed"
    # ... and a sweep asking for another one starts the run anew
    fixed = load_sweep(write_sweep(tmp_path, small_config, [("fedavg", {}),
                                                            ("fedavg", {"tag": "broken", "set": ["train.lr=0.01"]})],
                                   set=["train.rounds=1"]))
    assert job_status(fixed.jobs[1]) == "new"

    # a finished run that lost its summary.json and keeps no checkpoint (a committed folder after a bad
    # merge): left alone, not started again from round 1 over the rounds it holds
    done = sweep.jobs[0]
    (done.run_dir / "checkpoint.pt").unlink()
    (done.run_dir / "checkpoint.sha256").unlink()
    (done.run_dir / "summary.json").write_text('{"status": "comp')
    assert job_status(done) == "damaged"
    messages = []
    assert run_sweep(load_sweep(path), only=["fedavg"], log=messages.append, poll_seconds=0.2) == {}
    assert any("skipped fedavg_s0, damaged: its summary.json is missing or unreadable" in m for m in messages)
    assert before == (done.run_dir / "metrics.jsonl").stat().st_mtime_ns
    assert "`fedavg_s0`: damaged (its summary.json is missing" in write_report(load_sweep(path))
    assert cli_main(["sweep", str(path), "--list", "--only", "fedavg"]) == 0
    assert "[its summary.json is missing or unreadable" in capsys.readouterr().out
    (done.run_dir / "metrics.jsonl").write_text("")          # nothing recorded: an interrupted run, resumed
    assert job_status(done) == "interrupted"


def test_a_killed_sweep_resumes_and_ends_with_the_uninterrupted_results(tmp_path, small_config, monkeypatch):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})])
    sweep = load_sweep(path)
    # fedprox was killed in its third round (after the checkpoint of round 2); fedavg never started.
    # It ran with the threads a sweep lane gives (torch's default on a many-core machine sums
    # floats in another order, and the comparison below is exact)
    job = next(j for j in sweep.jobs if j.tag == "fedprox")
    cfg = load_config(job.config, [*job.overrides, f"run.threads={lane_threads(sweep.lanes)}"])
    run_killed_in_round(Experiment.create(cfg, job.run_dir), monkeypatch, 2)
    assert job_status(job) == "interrupted" and len(read_metrics(job.run_dir)) == 2
    messages = []
    outcome = run_sweep(sweep, log=messages.append, poll_seconds=0.2)
    assert outcome == {"fedavg_s0": "completed", "fedprox_s0": "completed"}
    assert any("start  fedprox_s0 (resuming)" in m for m in messages)
    write_report(sweep)

    # the same runs uninterrupted, in this process as the killed one was: identical metrics (time aside)
    for job in sweep.jobs:
        fresh = tmp_path / "fresh" / job.name
        cfg = load_config(job.config, [*job.overrides, f"run.threads={lane_threads(sweep.lanes)}"])
        Experiment.create(cfg, fresh).run(progress=False)
        assert rows_without_time(job.run_dir) == rows_without_time(fresh), job.name
        sa = json.loads((job.run_dir / "summary.json").read_text())
        sb = json.loads((fresh / "summary.json").read_text())
        assert sa["metrics"] == sb["metrics"] and sa["status"] == sb["status"] == "completed"


def test_an_edited_sweep_file_leaves_runs_of_the_old_config_alone(tmp_path, small_config, capsys):
    path = write_sweep(tmp_path, small_config, [("fedavg", {})])
    run_sweep(load_sweep(path), log=lambda m: None, poll_seconds=0.2)
    good_table = write_report(load_sweep(path))
    good_plot = (tmp_path / "out" / "sweep.png").read_bytes()
    edited = write_sweep(tmp_path, small_config, [("fedavg", {"set": ["train.lr=0.01"]})])
    sweep = load_sweep(edited)
    (job,) = sweep.jobs
    assert job_status(job) == "stale"
    messages = []
    assert run_sweep(sweep, log=messages.append, poll_seconds=0.2) == {}
    assert any("train.lr: 0.05 -> 0.01" in m for m in messages)
    # --list and --table say what differs; --table keeps the table of the runs as they were made
    assert cli_main(["sweep", str(edited), "--list"]) == 0
    captured = capsys.readouterr()
    assert "[train.lr: 0.05 -> 0.01]" in captured.out and "1 run(s) stale: " in captured.err
    assert cli_main(["sweep", str(edited), "--table"]) == 0
    captured = capsys.readouterr()
    assert "- `fedavg_s0`: stale (train.lr: 0.05 -> 0.01)" in captured.out
    assert "give the --set the runs were made with" in captured.err and "is kept as it was" in captured.err
    assert (sweep.out / "sweep.md").read_text() == good_table
    assert (sweep.out / "sweep.png").read_bytes() == good_plot
    # a sweep file whose config no longer loads does not pool the existing run as its own
    broken = load_sweep(write_sweep(tmp_path, small_config, [("fedavg", {"set": ["train.lr=-1"]})]))
    assert job_status(broken.jobs[0]) == "stale"
    assert any("cannot be loaded" in x for x in config_mismatch(broken.jobs[0]))
    # a sweep file may not pool two different experiments under one tag
    bad = write_sweep(tmp_path, small_config, [("fedavg", {"seeds": [0]}), ("fedprox", {"tag": "fedavg", "seeds": [1]})])
    with pytest.raises(ConfigError, match="tag 'fedavg' is also used"):
        load_sweep(bad)


def test_paired_differences_per_seed_against_a_baseline(tmp_path, small_config):
    from fedhet.experiment.report import compare

    dirs, finals = [], {}
    for algo in ("fedavg", "fedprox"):
        for seed in (0, 1):
            raw = copy.deepcopy(small_config)
            raw.update(name=algo, seed=seed, algorithm={"name": algo, "params": {"mu": 0.5} if algo == "fedprox" else {}})
            raw["train"]["rounds"] = 1
            exp = Experiment.create(load_config(raw=raw), tmp_path / f"{algo}_s{seed}")
            summary = exp.run(progress=False)
            dirs.append(exp.run_dir)
            finals[(algo, seed)] = 100 * summary["metrics"]["global_acc"]["final"]
    text = compare(dirs, None, None, paired="fedavg")
    d = [finals[("fedprox", s)] - finals[("fedavg", s)] for s in (0, 1)]
    mean, std = sum(d) / 2, abs(d[0] - d[1]) / 2 ** 0.5
    assert f"| fedprox | 2 | s0: {d[0]:+.2f}, s1: {d[1]:+.2f} | {mean:+.2f} ± {std:.2f} | {sum(x > 0 for x in d)}/2 |" in text
    assert "| fedavg | 2 |" not in text.split("Paired differences")[1]
    # a method whose headline is another metric (a personalized one) is paired on the baseline's
    for seed in (0, 1):
        path = tmp_path / f"fedprox_s{seed}" / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "headline_metric": "personal_acc"}))
    assert compare(dirs, None, None, paired="fedavg").split("Paired differences")[1] == text.split("Paired differences")[1]
    assert "at best val" not in text                  # these runs hold out no validation split
    # runs that record the best-validation round (FedFM's reporting rule) get its column and pairs
    chosen = {("fedavg", 0): 0.5, ("fedavg", 1): 0.6, ("fedprox", 0): 0.55, ("fedprox", 1): 0.58}
    for (algo, seed), value in chosen.items():
        path = tmp_path / f"{algo}_s{seed}" / "summary.json"
        rule = "global_acc at the first evaluated round with the highest global_val_acc"
        path.write_text(json.dumps({**json.loads(path.read_text()), "headline_metric": "global_acc",
                                    "model_selection": {"value": value, "round": 1, "validation": 0.9, "rule": rule}}))
    text = compare(dirs, None, None, paired="fedavg")
    assert "| 55.00 ± 7.07 |" in text.split("\n")[2] and "| 56.50 ± 2.12 |" in text.split("\n")[3], text
    tail = text.split("at the best-validation round against fedavg")[1]
    assert "| fedprox | 2 | s0: +5.00, s1: -2.00 | +1.50 ± 4.95 | 1/2 |" in tail, tail
    # a run of another length is paired with a line that says so; one without the metric is named
    edit = {"fedprox_s1": lambda s: {**s, "rounds_completed": 2},
            "fedprox_s0": lambda s: {**s, "metrics": {**s["metrics"], "global_acc": {}}}}
    for run, change in edit.items():
        path = tmp_path / run / "summary.json"
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    text = compare(dirs, None, None, paired="fedavg")
    assert "| fedprox | 1 | s1: " in text
    assert text.endswith("Not paired where the run recorded no global_acc: fedprox (s0).\n\nPaired runs of different "
                         "lengths, whose final values come from different rounds: fedprox s1 (2 rounds against "
                         "fedavg's 1)."), text
    with pytest.raises(CheckpointError, match="no completed run of that name"):
        compare(dirs, None, None, paired="scaffold")
    with pytest.raises(CheckpointError, match="is given twice"):
        compare([*dirs, dirs[0]], None, None, paired="fedavg")
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], paired="nobody")
    with pytest.raises(ConfigError, match="not the tag of any run"):
        load_sweep(path)


def test_a_run_on_another_split_is_not_paired_with_the_baseline_of_its_seed(tmp_path, small_config):
    """A sweep over two splits with one ``paired`` baseline (FedClassAvg's Dir(0.5) and skewed split):
    seed 0 of the other split ran on other clients' data, so its difference from the baseline's seed
    0 is no paired comparison and gets no row; the seeds left out are named under the table."""
    import shutil

    from fedhet.experiment.report import compare

    dirs, finals = {}, {}
    for name, algo, alpha in (("fedavg", "fedavg", 0.5), ("fedprox", "fedprox", 0.5), ("fedprox_iid", "fedprox", 100.0)):
        raw = copy.deepcopy(small_config)
        raw.update(name=name, seed=0, algorithm={"name": algo})
        raw["data"]["partition"]["alpha"] = alpha
        raw["train"]["rounds"] = 1
        exp = Experiment.create(load_config(raw=raw), tmp_path / f"{name}_s0")
        finals[name] = 100 * exp.run(progress=False)["metrics"]["global_acc"]["final"]
        dirs[name] = exp.run_dir
    text = compare(list(dirs.values()), None, None, paired="fedavg")
    d = finals["fedprox"] - finals["fedavg"]
    pairs = text.split("Paired differences")[1]
    assert f"| fedprox | 1 | s0: {d:+.2f} |" in pairs and "| fedprox_iid |" not in pairs
    assert text.endswith("Not paired with fedavg where they ran on other per-client label counts than its run "
                         "of the seed (another partition.json): fedprox_iid (s0).")

    def as_seed(name: str, seed: int):
        """A copy of ``name``'s seed-0 run recorded as seed ``seed`` (its partition.json kept)."""
        copied = tmp_path / f"{name}_s{seed}"
        shutil.copytree(dirs[name], copied)
        summary = json.loads((copied / "summary.json").read_text())
        (copied / "summary.json").write_text(json.dumps({**summary, "seed": seed}))
        return copied

    # seed 1: fedprox on the baseline's data again, fedprox_iid now on it too, but fedprox's seed-2
    # copy has no baseline run to pair with; seed 1 of fedprox_iid pairs, its seed 0 still does not
    more = [as_seed("fedavg", 1), as_seed("fedprox", 1), as_seed("fedprox", 2), as_seed("fedprox_iid", 1)]
    shutil.copy(dirs["fedavg"] / "partition.json", tmp_path / "fedprox_iid_s1" / "partition.json")
    text = compare([*dirs.values(), *more], None, None, paired="fedavg")
    pairs = text.split("Paired differences")[1]
    assert f"| fedprox | 2 | s0: {d:+.2f}, s1: {d:+.2f} |" in pairs, pairs
    iid = finals["fedprox_iid"] - finals["fedavg"]
    assert f"| fedprox_iid | 1 | s1: {iid:+.2f} |" in pairs, pairs
    assert "fedprox_iid (s0)." in text
    assert ("Not paired with fedavg where fedavg has no run of the seed: fedprox (s2).\n\nNot paired with fedavg "
            "where they ran on other") in text
    # a run without a readable partition.json is named, not paired, and nothing else is lost
    (tmp_path / "fedprox_s1" / "partition.json").write_text("{not json")
    (tmp_path / "fedprox_iid_s0" / "partition.json").unlink()
    text = compare([*dirs.values(), *more], None, None, paired="fedavg")
    assert f"| fedprox | 1 | s0: {d:+.2f} |" in text
    assert text.endswith("Not paired with fedavg where one of the two runs has no readable partition.json to tell "
                         "whether they ran on the same data: fedprox (s1), fedprox_iid (s0).")
    (tmp_path / "fedavg_s0" / "partition.json").unlink()           # the baseline's own: its seed pairs nothing
    assert "fedprox (s0, s1), fedprox_iid (s0)." in compare([*dirs.values(), *more], None, None, paired="fedavg")
    with pytest.raises(CheckpointError, match="no completed run of that name"):
        compare([*dirs.values(), *more], None, None, paired="fedavg_typo")


def test_a_baseline_a_split_pairs_each_run_with_the_baseline_on_its_data(tmp_path, small_config):
    """``--paired`` twice (a sweep's ``paired: [a, b]``): each run is paired at a seed with the
    baseline that ran on its per-client label counts, one table a baseline; a run on neither's data
    is named under the tables."""
    from fedhet.experiment.report import compare

    dirs, finals = {}, {}
    for name, algo, alpha, seed in (("fedavg", "fedavg", 0.5, 0), ("fedprox", "fedprox", 0.5, 0),
                                    ("fedavg_iid", "fedavg", 100.0, 0), ("fedprox_iid", "fedprox", 100.0, 0),
                                    ("fedprox_iid", "fedprox", 100.0, 1), ("fedprox_b", "fedprox", 0.1, 0)):
        raw = copy.deepcopy(small_config)
        raw.update(name=name, seed=seed, algorithm={"name": algo})
        raw["data"]["partition"]["alpha"] = alpha
        raw["train"]["rounds"] = 1
        exp = Experiment.create(load_config(raw=raw), tmp_path / f"{name}_s{seed}")
        finals[name, seed] = 100 * exp.run(progress=False)["metrics"]["global_acc"]["final"]
        dirs[name, seed] = exp.run_dir
    text = compare(list(dirs.values()), None, None, paired=["fedavg", "fedavg_iid"])
    first, second = text.split("Paired differences")[1:]
    d = finals["fedprox", 0] - finals["fedavg", 0]
    iid = finals["fedprox_iid", 0] - finals["fedavg_iid", 0]
    assert first.startswith(" of final global_acc against fedavg ") and f"| fedprox | 1 | s0: {d:+.2f} |" in first
    assert "fedprox_iid" not in first and "| fedavg_iid |" not in first, first
    assert second.startswith(" of final global_acc against fedavg_iid ") and "| fedprox |" not in second
    assert f"| fedprox_iid | 1 | s0: {iid:+.2f} |" in second and "| fedavg |" not in second, second
    assert text.endswith("Not paired with any of fedavg, fedavg_iid where none of them has a run of the seed: "
                         "fedprox_iid (s1).\n\nNot paired with any of fedavg, fedavg_iid where they ran on other "
                         "per-client label counts than their runs of the seed (another partition.json): fedprox_b (s0).")
    # two baselines on one split: a run on their data is in both tables, and each baseline in the other's
    text = compare(list(dirs.values()), None, None, paired=["fedavg", "fedprox"])
    first, second = text.split("Paired differences")[1:]
    assert f"| fedprox | 1 | s0: {d:+.2f} |" in first and f"| fedavg | 1 | s0: {-d:+.2f} |" in second
    assert "Not paired with any of fedavg, fedprox where they ran on other per-client label counts than their " \
           "runs of the seed (another partition.json): fedavg_iid (s0), fedprox_b (s0), fedprox_iid (s0)." in text
    (dirs["fedprox_b", 0] / "partition.json").unlink()
    assert text.replace("fedprox_b (s0), ", "") + ("\n\nNot paired with any of fedavg, fedprox where the run or a "
                                                 "baseline's run of the seed has no readable partition.json to "
                                                 "tell whether they ran on the same data: fedprox_b (s0).") == \
        compare(list(dirs.values()), None, None, paired=["fedavg", "fedprox"])
    # a sweep names one baseline or a list of them; every entry must be a tag of the sweep
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], paired=["fedavg", "fedprox"])
    assert load_sweep(path).paired == ["fedavg", "fedprox"]
    assert load_sweep(write_sweep(tmp_path, small_config, [("fedavg", {})], paired="fedavg")).paired == ["fedavg"]
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], paired=["fedavg", "fedavgg"])
    with pytest.raises(ConfigError, match="'fedavgg' is not the tag of any run"):
        load_sweep(path)


def test_a_job_another_sweep_runs_is_left_alone_and_a_dead_lock_is_ignored(tmp_path, small_config):
    import os
    import subprocess
    import sys

    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], set=["train.rounds=1"])
    sweep = load_sweep(path)
    sweep.out.mkdir(parents=True)
    held, dead = sweep.jobs
    (sweep.out / f"{held.name}.lock").write_text(f"{os.getpid()}\n")            # a live process holds it
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (sweep.out / f"{dead.name}.lock").write_text(f"{gone.pid}\n")                 # its process has exited
    assert job_status(held) == "running" and job_status(dead) == "new"
    messages = []
    outcome = run_sweep(sweep, log=messages.append, poll_seconds=0.2)
    assert outcome == {dead.name: "completed"}
    assert any(f"skipped {held.name}: another sweep process runs it" in m for m in messages)
    assert any("2 runs, 1 running elsewhere left alone, 1 to run" in m for m in messages)
    assert not (sweep.out / f"{dead.name}.lock").exists() and not held.run_dir.exists()


def test_a_raised_round_count_extends_completed_runs(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=2"])
    run_sweep(load_sweep(path), log=lambda m: None, poll_seconds=0.2)
    longer = write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=3"])
    sweep = load_sweep(longer)
    (job,) = sweep.jobs
    assert job_status(job) == "extend"
    messages = []
    assert run_sweep(sweep, log=messages.append, poll_seconds=0.2) == {job.name: "completed"}
    assert any("(resuming)" in m for m in messages) and job_status(job) == "completed"
    # the same as a 3-round run from the start (in this process, with a lane's threads)
    cfg = load_config(job.config, [*job.overrides, f"run.threads={lane_threads(sweep.lanes)}"])
    Experiment.create(cfg, tmp_path / "fresh").run(progress=False)
    assert rows_without_time(job.run_dir) == rows_without_time(tmp_path / "fresh")
    assert [r["round"] for r in read_metrics(job.run_dir)] == [1, 2, 3]


def test_an_extension_the_run_refuses_fails_once_and_leaves_the_run_as_it_was(tmp_path, small_config):
    """FedFM-Lite (model_every 2) whose 3-round run uploaded in round 3 only as its last refuses
    to be extended to 4 (Algorithm.extension_problem): the sweep reports it failed with the reason,
    the run's config.yaml still says 3 rounds (the run records a raise only once it accepts it), and
    the next sweep does not start it again."""
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "fedfm_lite", "params": {"start_round": 0, "model_every": 2, "lam": 1.0}}
    raw["data"]["pool_fraction"] = 0.25
    (tmp_path / "lite.yaml").write_text(yaml.safe_dump(raw))
    spec = {"name": "lite", "out": str(tmp_path / "out"), "seeds": [0], "set": ["train.rounds=3"],
            "runs": [{"config": str(tmp_path / "lite.yaml"), "tag": "lite"}]}
    (tmp_path / "lite.sweep.yaml").write_text(yaml.safe_dump(spec))
    (job,) = load_sweep(tmp_path / "lite.sweep.yaml").jobs
    Experiment.create(load_config(job.config, [*job.overrides, "run.threads=1"]), job.run_dir).run(progress=False)
    spec["set"] = ["train.rounds=4"]
    (tmp_path / "lite.sweep.yaml").write_text(yaml.safe_dump(spec))
    (job,) = load_sweep(tmp_path / "lite.sweep.yaml").jobs
    assert job_status(job) == "extend"
    assert run_sweep(load_sweep(tmp_path / "lite.sweep.yaml"), log=lambda m: None, poll_seconds=0.2) == {
        job.name: "failed"}
    assert "uploaded and averaged the models only because it was the last" in (
        job.run_dir.parent / f"{job.name}.log").read_text()
    assert load_config(job.run_dir / "config.yaml").train.rounds == 3 and job_status(job) == "failed"
    assert run_sweep(load_sweep(tmp_path / "lite.sweep.yaml"), log=lambda m: None, poll_seconds=0.2) == {}


def test_a_raised_round_count_reaches_interrupted_runs_too(tmp_path, small_config, monkeypatch):
    """An interrupted run is resumed with the rounds the sweep file asks for now (it used to stop
    at its old count and be reported failed)."""
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=3"])
    (job,) = load_sweep(path).jobs
    cfg = load_config(job.config, [*job.overrides, "run.threads=1"])
    run_killed_in_round(Experiment.create(cfg, job.run_dir), monkeypatch, 2)
    longer = load_sweep(write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=4"]))
    assert job_status(longer.jobs[0]) == "interrupted"
    assert run_sweep(longer, log=lambda m: None, poll_seconds=0.2) == {job.name: "completed"}
    assert [r["round"] for r in read_metrics(job.run_dir)] == [1, 2, 3, 4]


def test_sigterm_stops_a_background_sweep_and_its_runs_like_ctrl_c(tmp_path, small_config):
    """A sweep started in the background (SIGINT ignored, as `&` does) gets SIGTERM: it stops its
    run with SIGTERM, the run records status "interrupted" (summary written, rows kept), the lock
    is released, and the sweep exits 130."""
    import signal
    import subprocess
    import sys
    import time

    import torch

    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 200
    raw["run"]["checkpoint_every"] = 1000       # only the stop checkpoints
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(raw))
    spec = {"name": "long", "out": str(tmp_path / "out"), "lanes": 1, "seeds": [0],
            "runs": [{"config": str(tmp_path / "long.yaml"), "tag": "fedavg"}]}
    (tmp_path / "long.sweep.yaml").write_text(yaml.safe_dump(spec))
    (job,) = load_sweep(tmp_path / "long.sweep.yaml").jobs
    # one thread for its run, as the sweeps of this file plan (tests/conftest.py, sweep_lanes_plan_for_one_cpu)
    sweep = subprocess.Popen([sys.executable, "-m", "fedhet.cli", "sweep", str(tmp_path / "long.sweep.yaml"),
                              "--set", "run.threads=1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        end = time.monotonic() + 240
        while not read_metrics(job.run_dir) and time.monotonic() < end and sweep.poll() is None:
            time.sleep(0.5)
        assert read_metrics(job.run_dir), "the run never finished a round"
        sweep.send_signal(signal.SIGTERM)
        out, _ = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 130, out
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] >= 1
    assert job_status(job) == "interrupted" and not (job.run_dir.parent / f"{job.name}.lock").exists()
    # the run let its round end and checkpointed it
    done = summary["rounds_completed"]
    assert summary["error"] == f"stopped after round {done}: SIGTERM received"
    assert torch.load(job.run_dir / "checkpoint.pt", weights_only=False)["round"] == done
    log = (job.run_dir.parent / f"{job.name}.log").read_text()
    assert f"fedhet: stopped after round {done} of 200; its checkpoint of round {done} keeps the run" in log, log[-2000:]


def test_a_job_finished_by_another_sweep_after_this_one_started_is_not_run_again(tmp_path, small_config,
                                                                                 monkeypatch):
    """Between this sweep's first look and its turn for the job, another sweep ran it to the end:
    once it holds the lock this sweep looks again and leaves the completed run alone."""
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=1"])
    sweep = load_sweep(path)
    (job,) = sweep.jobs
    real_take = sweep_lanes.take_lock

    def take_after_another_sweep_finished(j):
        cfg = load_config(j.config, [*j.overrides, "run.threads=1"])
        Experiment.create(cfg, j.run_dir).run(progress=False)
        return real_take(j)

    monkeypatch.setattr(sweep_lanes, "take_lock", take_after_another_sweep_finished)
    messages = []
    assert run_sweep(sweep, log=messages.append, poll_seconds=0.2) == {}
    assert any("skip   fedavg_s0: completed meanwhile" in m for m in messages), messages
    assert job_status(job) == "completed" and not (job.run_dir.parent / f"{job.name}.lock").exists()


def test_reading_runs_never_imports_torch(tmp_path):
    """`fedhet sweep --list`, `--table` and `fedhet compare` only read run folders: in a fresh
    process they answer without loading torch (about 2 s of CPU a call on 2 cores), here on a
    committed sweep's runs copied out of the repository."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sweep_file = root / "benchmarks" / "fedfm_fmnist_t100_e1.sweep.yaml"
    runs = [root / "benchmarks" / "runs" / "fedfm_fmnist_t100_e1" / name for name in ("fedavg_s0", "fedfm_lam5_s0")]
    for run in runs:
        shutil.copytree(run, tmp_path / "out" / run.name)
    code = ("import sys\nfrom fedhet.cli import main\n"
            f"assert main(['sweep', {str(sweep_file)!r}, '--out', {str(tmp_path / 'out')!r}, '--list']) == 0\n"
            f"assert main(['sweep', {str(sweep_file)!r}, '--out', {str(tmp_path / 'out')!r}, '--table']) == 0\n"
            f"assert main(['compare', *{[str(tmp_path / 'out' / r.name) for r in runs]!r}]) == 0\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "completed" in out.stdout and "| fedavg" in out.stdout, out.stdout[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no torch", out.stdout[-2000:]


def test_a_configs_own_run_threads_giving_way_to_the_lanes_share_is_said(tmp_path, small_config):
    raw = copy.deepcopy(small_config)
    raw["run"]["threads"] = 3
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(raw))
    spec = {"name": "own", "out": str(tmp_path / "out"), "lanes": 1, "seeds": [0], "set": ["train.rounds=1"],
            "runs": [{"config": str(tmp_path / "own.yaml"), "tag": "fedavg"}]}
    (tmp_path / "own.sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep = load_sweep(tmp_path / "own.sweep.yaml")
    messages: list[str] = []
    assert run_sweep(sweep, log=messages.append, poll_seconds=0.2) == {"fedavg_s0": "completed"}
    threads = sweep_threads(sweep)
    assert (f"run.threads of {tmp_path / 'own.yaml'} is replaced by the sweep's {threads} a run (its lanes' share "
            "of the CPUs); fedhet sweep FILE --set run.threads=N chooses another") in messages, messages
    assert load_config(sweep.jobs[0].run_dir / "config.yaml").run.threads == threads


def test_a_failed_run_retried_without_a_checkpoint_is_said_to_start_again(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {"tag": "diverge", "set": ["train.lr=1.0e+8"]})],
                       set=["train.rounds=1"])
    run_sweep(load_sweep(path), log=lambda m: None, poll_seconds=0.2)
    (job,) = load_sweep(path).jobs
    assert job_status(job) == "failed" and not (job.run_dir / "checkpoint.pt").exists()
    messages = []
    run_sweep(load_sweep(path), retry_failed=True, log=messages.append, poll_seconds=0.2)
    assert any("start  diverge_s0 (again from round 1: its folder keeps no checkpoint)" in m for m in messages)
