"""benchmarks/per_round.py, the script behind the per-round and per-client figures quoted in
benchmarks/results/: hand-made metrics.jsonl files and the figures they must give."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import benchmark_script, write_metrics


@pytest.fixture(scope="module")
def per_round():
    return benchmark_script("per_round")


def write_run(folder: Path, rows: list[dict]) -> Path:
    write_metrics(folder, rows)
    return folder


@pytest.fixture
def two_runs(tmp_path):
    # evaluated every 5 rounds; round 12 is a training-only row
    first = write_run(tmp_path / "a", [
        {"round": 5, "local_kl": 2.0, "personal_acc": 0.50, "local_kl_by_client": {"0": 1.0, "1": 3.0}},
        {"round": 10, "local_kl": 1.0, "personal_acc": 0.70, "local_kl_by_client": {"0": 0.5, "1": 1.5}},
        {"round": 12, "train_loss": 0.3},
        {"round": 15, "local_kl": 1.5, "personal_acc": 0.60, "local_kl_by_client": {"0": 2.0, "1": 1.0}}])
    second = write_run(tmp_path / "b", [
        {"round": 5, "local_kl": 2.5, "personal_acc": 0.40, "local_kl_by_client": {"0": 2.0, "1": 3.0}},
        {"round": 10, "local_kl": 0.5, "personal_acc": 0.75, "local_kl_by_client": {"0": 1.0, "1": 1.0}},
        {"round": 15, "local_kl": 1.3, "personal_acc": 0.65, "local_kl_by_client": {"0": 2.0, "1": 0.5}}])
    return first, second


def test_a_kl_is_best_lowest_and_printed_as_recorded(per_round, two_runs, capsys):
    per_round.main([str(two_runs[0]), "--metric", "local_kl", "--at", "5", "15", "--window", "6", "15"])
    out = capsys.readouterr().out
    assert "3 evaluated rounds; best 1.00 (round 10)" in out
    assert "at 5: 2.00, 15: 1.50" in out
    assert "mean over rounds 6-15: 1.25" in out           # rounds 10 and 15 only; 12 has no local_kl


def test_accuracy_is_best_highest_in_percent(per_round, two_runs, capsys):
    per_round.main([str(two_runs[0]), "--range", "5", "15", "--loss-at", "12"])
    out = capsys.readouterr().out
    assert "best 70.00 (round 10)" in out
    assert "rounds 5-15: min 50.00, max 70.00" in out
    assert "train_loss at 12: 0.3000" in out


def test_two_runs_differences_and_client_by_client(per_round, two_runs, capsys):
    per_round.main([*map(str, two_runs), "--metric", "local_kl", "--range", "10", "15", "--by-client"])
    out = capsys.readouterr().out
    # |2.0-2.5|, |1.0-0.5|, |1.5-1.3|: max 0.5, mean 0.4
    assert "|difference| over 3 shared rounds: max 0.50, mean 0.40" in out
    # round 10: client 0 0.5 < 1.0 (below), client 1 1.5 > 1.0 (above); round 15: client 0 2.0 = 2.0
    # (neither), client 1 1.0 > 0.5 (above)
    assert "rounds [10, 15]: first run below at 1, above at 2 client evaluations" in out
    assert "first run ahead at 0 of 2 shared rounds in rounds 10-15" in out    # a KL: lower is ahead; 1.0 > 0.5, 1.5 > 1.3


@pytest.mark.parametrize(("metric", "span", "ahead"), [
    ("personal_acc", [], "first run ahead at 1 of 3 shared rounds\n"),                # 50 > 40 at round 5 only
    ("personal_acc", ["--range", "10", "15"], "first run ahead at 0 of 2 shared rounds in rounds 10-15"),
    ("local_kl", [], "first run ahead at 1 of 3 shared rounds\n"),                    # lower is ahead: round 10
])
def test_two_runs_count_the_rounds_the_first_is_ahead(per_round, two_runs, capsys, metric, span, ahead):
    per_round.main([*map(str, two_runs), "--metric", metric, *span])
    assert ahead in capsys.readouterr().out


def test_each_range_gets_its_own_lines(per_round, two_runs, capsys):
    per_round.main([*map(str, two_runs), "--range", "5", "5", "--range", "10", "15"])
    out = capsys.readouterr().out
    assert "rounds 5-5: min 50.00, max 50.00" in out and "rounds 10-15: min 60.00, max 70.00" in out
    assert "first run ahead at 1 of 1 shared rounds in rounds 5-5" in out      # 50 > 40
    assert "first run ahead at 0 of 2 shared rounds in rounds 10-15" in out    # 70 < 75, 60 < 65


@pytest.mark.parametrize(("span", "message"), [(["--window", "11", "14"], "no evaluated round in --window 11 14"),
                                               (["--range", "16", "20"], "no evaluated round in --range 16 20")])
def test_a_window_or_range_without_evaluated_rounds_is_a_clear_error(per_round, two_runs, capsys, span, message):
    with pytest.raises(SystemExit):
        per_round.main([str(two_runs[0]), "--metric", "local_kl", *span])
    assert message in capsys.readouterr().err


def test_two_runs_without_a_round_in_common_are_a_clear_error(per_round, two_runs, tmp_path, capsys):
    later = write_run(tmp_path / "later", [{"round": 20, "local_kl": 1.0}])
    with pytest.raises(SystemExit):
        per_round.main([str(two_runs[0]), str(later), "--metric", "local_kl"])
    assert "the two runs evaluated no round in common" in capsys.readouterr().err


@pytest.fixture
def timed_run(tmp_path):
    # rounds 1-4 as a run records them: sample-steps and the engine's seconds; rounds 2 and 4 evaluated
    def timed(rnd, samples, train, evaluate):
        row = {"round": rnd, "samples": samples,
               "seconds": {"train": train, "aggregate": 0.1, "evaluate": evaluate, "total": train + evaluate + 0.1}}
        return {**row, "global_acc": 0.5} if evaluate else row
    return write_run(tmp_path / "timed", [timed(1, 1000, 2.0, 0.0), timed(2, 3000, 4.0, 10.0),
                                          timed(3, 2000, 1.0, 0.0), timed(4, 1000, 1.0, 12.0)])


def test_speed_pools_sample_steps_over_training_seconds(per_round, timed_run, capsys):
    per_round.main([str(timed_run), "--metric", "global_acc", "--speed", "--speed", "2", "3"])
    out = capsys.readouterr().out
    # all: 7,000 sample-steps in 8 s = 875 a second (the rounds' own: 500, 750, 2,000, 1,000; their mean, 1,062,
    # is not the pooled speed); evaluations at rounds 2 and 4: 22 s
    assert ("training, rounds 1-4 (4 timed): 7,000 sample-steps in 8 s, 875 samples/s (rounds 500-2,000); "
            "2 evaluations, 22 s") in out
    # rounds 2-3: 5,000 in 5 s
    assert "training, rounds 2-3 (2 timed): 5,000 sample-steps in 5 s, 1,000 samples/s (rounds 750-2,000); " \
           "1 evaluation, 10 s" in out


def test_speed_gives_the_median_of_a_rounds_whole_time(per_round, timed_run, capsys):
    per_round.main([str(timed_run), "--metric", "global_acc", "--speed", "1", "2", "--speed", "2", "4"])
    out = capsys.readouterr().out
    # whole rounds: 2.1, 14.1, 1.1, 13.1 s (training + 0.1 s aggregation + evaluation); rounds 1-2 median 8.1,
    # rounds 2-4 median 13.1 (not the mean, 9.43)
    assert "1 evaluation, 10 s; a round in all: median 8.10 s, 16 s together" in out
    assert "2 evaluations, 22 s; a round in all: median 13.10 s, 28 s together" in out


@pytest.mark.parametrize(("span", "message"), [(["--speed", "5", "9"], "no timed round in --speed 5 9"),
                                               (["--speed", "5"], "--speed takes no rounds or two (FIRST LAST), not 1")])
def test_speed_without_timed_rounds_or_with_one_round_is_a_clear_error(per_round, timed_run, capsys, span, message):
    with pytest.raises(SystemExit):
        per_round.main([str(timed_run), "--metric", "global_acc", *span])
    assert message in capsys.readouterr().err


def test_a_folder_without_metrics_is_named(per_round, tmp_path, capsys):
    with pytest.raises(SystemExit):
        per_round.main([str(tmp_path / "nothere"), "--at", "1"])
    assert f"{tmp_path / 'nothere'}: not a run folder (no metrics.jsonl there)" in capsys.readouterr().err


def test_client_by_client_reads_a_list_recorded_by_older_runs_as_the_mapping(per_round, tmp_path, capsys):
    """personal_acc_by_client: a list over all clients (None: not tested) in runs recorded before it
    became a mapping of the tested clients; one run of each kind compare client by client."""
    old = write_run(tmp_path / "old", [{"round": 5, "personal_acc": 0.5, "personal_acc_by_client": [0.4, None, 0.6]}])
    new = write_run(tmp_path / "new", [{"round": 5, "personal_acc": 0.6, "personal_acc_by_client": {"0": 0.5, "2": 0.5}}])
    per_round.main([str(old), str(new), "--range", "5", "5", "--by-client"])
    # client 0: 0.4 < 0.5 (below); client 2: 0.6 > 0.5 (above); client 1 tested by neither
    assert "first run below at 1, above at 1 client evaluations" in capsys.readouterr().out
