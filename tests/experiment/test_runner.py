"""End-to-end runs on the synthetic IDX data: determinism, resume, ledger, failures, CLI."""

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from helpers import run_killed_in_round, small_config_in

from fedhet.cli import main
from fedhet.core.errors import (
    CheckpointError,
    ConfigError,
    NumericalError,
    PartitionError,
)
from fedhet.data.federated import build_federation
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics

VOLATILE = {"seconds"}


def stable(rows):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def run(raw, out):
    exp = Experiment.create(load_config(raw=copy.deepcopy(raw)), out)
    exp.run(progress=False)
    return exp


@pytest.fixture(scope="module")
def finished_run_once(synth_root, tmp_path_factory):
    """The small config's 3-round run (checkpoint after round 3), trained once for this module's
    tests that damage or extend a copy of it."""
    base = tmp_path_factory.mktemp("finished_run")
    return run(small_config_in(synth_root, base / "runs"), base / "r").run_dir


@pytest.fixture
def finished_run(finished_run_once, tmp_path):
    return shutil.copytree(finished_run_once, tmp_path / "r")


def test_same_seed_same_metrics_and_weights(small_config, tmp_path):
    a = run(small_config, tmp_path / "a")
    b = run(small_config, tmp_path / "b")
    assert stable(read_metrics(a.run_dir)) == stable(read_metrics(b.run_dir))
    for k, v in a.loop.server_state["model"].items():
        assert torch.equal(v, b.loop.server_state["model"][k])
    other = dict(small_config, seed=4)
    c = run(other, tmp_path / "c")
    assert stable(read_metrics(c.run_dir)) != stable(read_metrics(a.run_dir))


def test_deterministic_asks_torch_for_deterministic_kernels_and_changes_no_cpu_number(small_config, tmp_path,
                                                                                     determinism_restored):
    """run.deterministic: torch's deterministic algorithms, cuDNN's deterministic convolutions without
    autotuning and the cuBLAS workspace setting, for the process. On a CPU, bitwise at a fixed thread
    count without it, the run's numbers and weights are those of the same run without it."""
    torch.backends.cudnn.benchmark = True
    plain = run(small_config, tmp_path / "plain")
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    asked = copy.deepcopy(small_config)
    asked["run"]["deterministic"] = True
    det = run(asked, tmp_path / "det")
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert stable(read_metrics(det.run_dir)) == stable(read_metrics(plain.run_dir))
    for k, v in plain.loop.server_state["model"].items():
        assert torch.equal(v, det.loop.server_state["model"][k])
    assert load_config(det.run_dir / "config.yaml").run.deterministic


def test_fedavg_learns_and_records_everything(small_config, tmp_path):
    exp = run(small_config, tmp_path / "r")
    rows = read_metrics(exp.run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[-1]["global_acc"] > 0.5            # 10 balanced classes: chance is 0.1
    for key in ("global_acc", "global_per_class", "global_labeldist_acc", "personal_acc", "personal_acc_std", "comm"):
        assert key in rows[-1]
    summary = json.loads((exp.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["headline_metric"] == "global_acc"
    assert summary["headline"]["final"] == pytest.approx(np.mean([r["global_acc"] for r in rows[-2:]]))
    assert summary["headline"]["best"] == max(r["global_acc"] for r in rows)
    assert "max of global_acc" in summary["headline"]["best_rule"]
    assert (exp.run_dir / "accuracy.png").stat().st_size > 1000
    assert (exp.run_dir / "config.yaml").exists() and (exp.run_dir / "partition.json").exists()


def test_fedavg_ledger_is_two_models_per_client_per_round(small_config, tmp_path):
    exp = run(small_config, tmp_path / "r")
    n_params = sum(v.numel() for v in exp.loop.server_state["model"].values())
    for row in read_metrics(exp.run_dir):
        assert row["comm"]["down/model"]["floats"] == 3 * n_params
        assert row["comm"]["up/model"]["floats"] == 3 * n_params
        assert row["comm"]["up/model"]["bytes"] == 4 * 3 * n_params
    totals = exp.summary["communication"]
    assert totals["up"]["floats"] + totals["down"]["floats"] == 2 * 3 * 3 * n_params


def resumed_as_uninterrupted(run_dir, start_round: int, full: Experiment) -> Experiment:
    """Resume ``run_dir`` (from ``start_round``) to its end: its rows and model are ``full``'s, the
    uninterrupted run's."""
    resumed = Experiment.resume(run_dir)
    assert resumed.start_round == start_round
    resumed.run(progress=False)
    assert stable(read_metrics(resumed.run_dir)) == stable(read_metrics(full.run_dir))
    for k, v in full.loop.server_state["model"].items():
        assert torch.equal(v, resumed.loop.server_state["model"][k])
    return resumed


def test_resume_equals_uninterrupted(small_config, tmp_path, monkeypatch):
    cfg = dict(small_config, train={**small_config["train"], "rounds": 4})
    full = run(cfg, tmp_path / "full")

    exp = Experiment.create(load_config(raw=copy.deepcopy(cfg)), tmp_path / "cut")
    run_killed_in_round(exp, monkeypatch, 3)   # rounds 1-3 recorded, checkpoint after round 2
    assert [r["round"] for r in read_metrics(exp.run_dir)] == [1, 2, 3]
    assert json.loads((exp.run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert exp.stop_note() == (f"stopped during round 4 of 4; its checkpoint of round 2 keeps the run: fedhet run "
                               f"--resume {exp.run_dir} goes on from round 3 (round 3 runs again: a checkpoint every "
                               "2 rounds, run.checkpoint_every)")

    resumed = resumed_as_uninterrupted(exp.run_dir, 2, full)
    assert resumed.summary["communication"] == full.summary["communication"]


def stop_asked_in_round(exp, monkeypatch, rnd: int, why: str) -> None:
    """``exp`` asks itself to stop while 0-based round ``rnd`` runs (as fedhet run's first signal would)."""
    real = exp.loop.run_round

    def asked(r, *args):
        if r == rnd:
            exp.request_stop(why)
        return real(r, *args)

    monkeypatch.setattr(exp.loop, "run_round", asked)


def test_a_stop_asked_for_ends_the_round_checkpoints_it_and_resumes_as_uninterrupted(small_config, tmp_path,
                                                                                         monkeypatch):
    """request_stop (fedhet run's first Ctrl-C or SIGTERM) in mid-round: that round ends, is recorded
    and checkpointed though run.checkpoint_every is further off, and the run ends "interrupted"; a
    resume goes on from the next round and ends with the uninterrupted run's metrics and model."""
    cfg = dict(small_config, train={**small_config["train"], "rounds": 4},
               run={**small_config["run"], "checkpoint_every": 10})
    full = run(cfg, tmp_path / "full")
    exp = Experiment.create(load_config(raw=copy.deepcopy(cfg)), tmp_path / "cut")
    stop_asked_in_round(exp, monkeypatch, 1, "SIGTERM received")
    with pytest.raises(KeyboardInterrupt, match="^stopped after round 2: SIGTERM received\n"):
        exp.run(progress=False)
    assert [r["round"] for r in read_metrics(exp.run_dir)] == [1, 2]
    summary = json.loads((exp.run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("interrupted", "stopped after round 2: SIGTERM received")
    assert exp.stop_note() == (f"stopped after round 2 of 4; its checkpoint of round 2 keeps the run: fedhet run "
                               f"--resume {exp.run_dir} goes on from round 3")
    resumed_as_uninterrupted(exp.run_dir, 2, full)


def test_a_stop_asked_for_in_the_last_round_lets_the_run_complete(small_config, tmp_path, monkeypatch):
    exp = Experiment.create(load_config(raw=copy.deepcopy(small_config)), tmp_path / "last")
    stop_asked_in_round(exp, monkeypatch, 2, "SIGINT received")          # 0-based: the last of 3
    assert exp.run(progress=False)["status"] == "completed"


def test_the_command_lines_first_signal_asks_for_a_stop_and_a_later_one_stops_at_once(capsys, monkeypatch):
    """fedhet run's handlers: SIGTERM (or Ctrl-C) asks the run to stop after its round and says so;
    the same stop arriving twice at once (a process group's and a sweep's) is one stop; a signal
    a second later raises KeyboardInterrupt; the handlers before come back."""
    import signal
    import threading
    import time
    from types import SimpleNamespace

    import fedhet.cli as cli

    assert threading.current_thread() is threading.main_thread()      # where signal handlers run
    exp = SimpleNamespace(stop_requested=None, rounds_recorded=3, checkpointed_round=2, round_running=4,
                          cfg=SimpleNamespace(train=SimpleNamespace(rounds=10)))
    exp.request_stop = lambda why: setattr(exp, "stop_requested", why)
    outside = signal.getsignal(signal.SIGINT)       # ignored where the tests run in the background
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)          # as in a terminal
        before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt, match="^SIGINT received again: stopped at once$"):
            with cli._stop_after_the_round(exp):
                signal.raise_signal(signal.SIGTERM)
                assert exp.stop_requested == "SIGTERM received"
                assert ("fedhet: SIGTERM: stopping after round 4 of 10, which a checkpoint will keep; SIGTERM "
                        "again stops at once (the last checkpoint is of round 2)") in capsys.readouterr().err
                signal.raise_signal(signal.SIGTERM)                        # at once: the same stop
                later = time.monotonic() + 2
                monkeypatch.setattr(cli.time, "monotonic", lambda: later)
                signal.raise_signal(signal.SIGINT)
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
        # an ignored SIGINT (a job started with & from a script) stays ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exp.stop_requested = None
        with cli._stop_after_the_round(exp):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in before
    finally:
        signal.signal(signal.SIGINT, outside)


def test_what_an_interrupted_run_says_of_where_it_stopped(small_config, tmp_path):
    exp = Experiment.create(load_config(raw=copy.deepcopy(small_config)), tmp_path / "r")     # 3 rounds
    go_on = f"fedhet run --resume {exp.run_dir}"
    states = [  # (rounds recorded, checkpointed, stop asked for) -> the note
        ((0, 0, None), f"stopped during round 1 of 3; no checkpoint yet: {go_on} starts it again from round 1"),
        ((0, 0, "SIGINT received"), f"stopped during round 1 of 3; no checkpoint yet: {go_on} starts it again "
                                    "from round 1"),
        ((2, 2, "SIGINT received"), f"stopped after round 2 of 3; its checkpoint of round 2 keeps the run: {go_on} "
                                    "goes on from round 3"),
        ((2, 1, None), f"stopped during round 3 of 3; its checkpoint of round 1 keeps the run: {go_on} goes on "
                       "from round 2 (round 2 runs again: a checkpoint every 2 rounds, run.checkpoint_every)"),
        ((3, 3, "SIGINT received"), f"stopped while the summary of its 3 rounds was written: {go_on} writes it "
                                    "again"),
    ]
    for (done, kept, asked), said in states:
        exp.rounds_recorded, exp.checkpointed_round, exp.stop_requested = done, kept, asked
        assert exp.stop_note() == said
    exp.rundir.unlock()


def test_a_stop_asked_for_turns_only_a_dead_worker_into_an_interruption(small_config, tmp_path, monkeypatch):
    """With a stop asked for, workers killed with the run's process group end the run
    "interrupted"; any other error still fails it, with its own message."""
    from fedhet.engine.parallel import WorkerError

    for error, status in ((WorkerError("worker process 1 died"), "interrupted"), (RuntimeError("a bug"), "failed")):
        exp = Experiment.create(load_config(raw=copy.deepcopy(small_config)), tmp_path / status)

        def broken(rnd, *args, error=error, exp=exp):
            exp.request_stop("SIGTERM received")
            raise error

        monkeypatch.setattr(exp.loop, "run_round", broken)
        with pytest.raises(KeyboardInterrupt if status == "interrupted" else RuntimeError):
            exp.run(progress=False)
        summary = json.loads((exp.run_dir / "summary.json").read_text())
        assert summary["status"] == status
        assert summary["error"] == ("SIGTERM received; round 1 could not end: worker process 1 died"
                                    if status == "interrupted" else "RuntimeError: a bug")


def test_corrupt_checkpoint_is_a_clear_error_and_keeps_metrics(finished_run):
    run_dir = finished_run
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="is damaged: its content no longer matches the sha256"):
        Experiment.resume(run_dir)
    (run_dir / "checkpoint.sha256").unlink()          # a run from before the digest: torch says it
    with pytest.raises(CheckpointError, match="cannot read checkpoint"), pytest.warns(UserWarning, match="unchecked"):
        Experiment.resume(run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_changed_config_but_allows_more_rounds(finished_run):
    run_dir = finished_run  # 3 rounds, checkpoint after round 3
    config_file = run_dir / "config.yaml"
    original = config_file.read_text()
    config_file.write_text(original.replace("lr: 0.05", "lr: 0.5").replace("alpha: 0.5", "alpha: 0.1"))
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError) as err:
        Experiment.resume(run_dir)
    msg = str(err.value)
    assert "train.lr: 0.05 -> 0.5" in msg and "data.partition" in msg and "alpha" in msg
    assert (run_dir / "metrics.jsonl").read_text() == before        # nothing recorded is lost
    # raising train.rounds (and run.* settings) extends the run
    config_file.write_text(original.replace("rounds: 3", "rounds: 4").replace("progress: false", "progress: true"))
    resumed = Experiment.resume(run_dir)
    assert resumed.start_round == 3
    resumed.run(progress=False)
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    config_file.write_text(original)                                    # fewer rounds than done: refused
    with pytest.raises(CheckpointError, match="train.rounds 3 is below the 4 rounds .* has done: a resumed run can "
                                              "be extended, not cut"):
        Experiment.resume(run_dir)
    with pytest.raises(ConfigError, match=r"--set train.rouns: unknown key \(did you mean train.rounds\?\)"):
        Experiment.resume(run_dir, run_settings=["train.rouns=5"])     # a typo is named as one
    with pytest.raises(ConfigError, match="--set run.out_dir: a resumed run goes on in the folder it is resumed from"):
        Experiment.resume(run_dir, run_settings=["run.out_dir=elsewhere"])   # else silently without effect


def test_resume_takes_set_values_of_how_the_run_is_carried_out_only(small_config, tmp_path, monkeypatch, capsys):
    """``fedhet run --resume DIR --set run.engine=...`` (or run.device=cpu for a run stopped on a
    GPU): the run goes on that way and config.yaml records it; a --set that would change what the
    run computes is refused before anything is touched."""
    exp = Experiment.create(load_config(raw=small_config), tmp_path / "r")
    run_killed_in_round(exp, monkeypatch, 1)
    monkeypatch.undo()
    before = (exp.run_dir / "metrics.jsonl").read_text()
    assert main(["run", "--resume", str(exp.run_dir), "--set", "train.lr=0.3"]) == 2
    err = capsys.readouterr().err
    assert "train.lr would change what it computes" in err and "run.device" in err
    assert (exp.run_dir / "metrics.jsonl").read_text() == before and load_config(exp.run_dir / "config.yaml").train.lr == 0.05
    assert main(["run", "--resume", str(exp.run_dir), "--set", "run.engine=reference", "--set", " train.rounds=4",
                 "--no-progress"]) == 0
    assert [r["round"] for r in read_metrics(exp.run_dir)] == [1, 2, 3, 4]
    recorded = load_config(exp.run_dir / "config.yaml")
    assert (recorded.run.engine, recorded.train.rounds, recorded.run.threads) == ("reference", 4, None)
    assert json.loads((exp.run_dir / "summary.json").read_text())["engine"]["engine"] == "reference"


def test_an_extended_run_sets_aside_its_old_last_rounds_evaluation_and_summarizes_as_the_longer_run(
        small_config, tmp_path, capsys, monkeypatch):
    """eval.every 2: a 3-round run evaluates round 3 only as its last. Extended to 6 rounds, its
    rows and summary are those of a 6-round run (rounds 2, 4, 6 evaluated); round 3's evaluation
    stays in its row under evaluated_as_last_round, read by no summary."""
    raw = copy.deepcopy(small_config)
    raw["eval"].update(every=2, final_window=2)
    raw["train"]["rounds"] = 3
    Experiment.create(load_config(raw=raw), tmp_path / "extended").run(progress=False)
    assert main(["run", "--resume", str(tmp_path / "extended"), "--set", "train.rounds=6", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "round 3 was evaluated as the last round; a run of 6 rounds evaluates every 2" in err
    assert f"extending {tmp_path / 'extended'} from 3 to 6 rounds" in err
    assert main(["run", "--resume", str(tmp_path / "extended"), "--no-progress"]) == 0      # nothing left to run
    assert (f"{tmp_path / 'extended'} has all its 6 rounds: its summary and plot are written again "
            "(--set train.rounds=N extends it)") in capsys.readouterr().err
    raw["train"]["rounds"] = 6
    Experiment.create(load_config(raw=raw), tmp_path / "fresh").run(progress=False)
    rows = {name: [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(tmp_path / name)]
            for name in ("extended", "fresh")}
    kept = rows["extended"][2].pop("evaluated_as_last_round")
    assert kept["personal_acc"] > 0 and "global_acc" in kept and "global_acc" not in rows["extended"][2]
    assert rows["extended"] == rows["fresh"]
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("extended", "fresh")]
    for key in ("headline", "metrics", "model_selection", "rounds_completed"):
        assert summaries[0][key] == summaries[1][key], key
    # a crash-resume from a checkpoint off the evaluation schedule (round 3 of 6: not evaluated, not
    # the last) sets nothing aside and ends as the uninterrupted run
    raw["run"]["checkpoint_every"] = 3
    run_killed_in_round(Experiment.create(load_config(raw=raw), tmp_path / "killed"), monkeypatch, 5)
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["run", "--resume", str(tmp_path / "killed"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "evaluated as the last round" not in err and f"resuming {tmp_path / 'killed'} after round 3 of 6" in err
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(tmp_path / "killed")] == rows["fresh"]


def test_resume_refuses_a_run_whose_precision_would_resolve_otherwise(finished_run):
    """run.precision: auto resolves by device (bf16 where the hardware runs it natively): a run
    moved to another device must not go on in another precision. The checkpoint records the
    precision it trained in."""
    from fedhet.experiment.rundir import RunDir

    run_dir = finished_run
    rundir = RunDir(run_dir)
    snap = rundir.load_checkpoint()
    assert snap["precision"] == "fp32"
    snap["precision"] = "bf16"                       # as if it had trained on a bf16 device
    rundir.save_checkpoint(snap)
    with pytest.raises(CheckpointError, match="trained in bf16 and would go on in fp32"):
        Experiment.resume(run_dir, run_settings=["train.rounds=4"])
    assert load_config(run_dir / "config.yaml").train.rounds == 3          # nothing touched


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a short write then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
from fedhet.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_stops_with_a_message_and_keeps_the_recorded_rounds(small_config, tmp_path):
    """A file-size limit stands in for a full file system (the cnn2 checkpoint is ~23 MB)."""
    import subprocess
    import sys

    import yaml

    if not hasattr(__import__("signal"), "SIGXFSZ"):
        pytest.skip("no RLIMIT_FSIZE/SIGXFSZ on this platform")
    cfg = dict(small_config, train={**small_config["train"], "rounds": 2},
               run={**small_config["run"], "checkpoint_every": 1})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", FULL_DISK, "run", str(tmp_path / "c.yaml"), "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "cannot write" in r.stderr and "checkpoint.pt" in r.stderr and "--resume" in r.stderr
    assert "Traceback" not in r.stderr
    assert [row["round"] for row in read_metrics(out)] == [1]          # the round before the failure is kept
    assert not list(out.glob("*.tmp"))                                  # no half-written files left behind
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("command", ["run", "partition", "compare", "flower"])
def test_outputs_under_a_file_are_clear_errors(small_config, tmp_path, capsys, command):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(small_config))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = str(tmp_path / "c.yaml")
    args = {"run": ["run", cfg, "--out", str(blocker / "run"), "--no-progress"],
            "partition": ["partition", cfg, "--out", str(blocker / "p.png")],
            "compare": ["compare", str(tmp_path), "--plot", str(blocker / "c.png")],
            "flower": ["flower", "run", cfg, "--out", str(blocker / "run")]}[command]
    if command == "compare":
        run(small_config, tmp_path / "done")
        args[1] = str(tmp_path / "done")
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "cannot" in err and str(blocker) in err and "Traceback" not in err


def test_empty_config_file_says_it_is_empty(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("\n# nothing here\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(empty)


def test_non_finite_training_stops_with_named_cause_and_keeps_record(small_config, tmp_path):
    cfg = dict(small_config, train={**small_config["train"], "lr": 1e9})
    exp = Experiment.create(load_config(raw=cfg), tmp_path / "nan")
    with pytest.raises(NumericalError, match=r"round \d+, client \d+, algorithm fedavg"):
        exp.run(progress=False)
    summary = json.loads((exp.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "non-finite" in summary["error"]


def test_local_only_communicates_nothing_and_is_personalized(small_config, tmp_path):
    cfg = dict(small_config, algorithm={"name": "local"})
    exp = run(cfg, tmp_path / "local")
    rows = read_metrics(exp.run_dir)
    assert all(r["comm"] == {} for r in rows)
    assert "global_acc" not in rows[-1] and "personal_acc" in rows[-1]
    assert exp.summary["headline_metric"] == "personal_acc"
    trained = sorted(exp.loop.client_states)
    assert trained == sorted({c for r in rows for c in r["clients"]})
    w0 = exp.loop.client_states[trained[0]]["model"]["head.fc2.weight"]
    w1 = exp.loop.client_states[trained[1]]["model"]["head.fc2.weight"]
    assert not torch.equal(w0, w1)


def test_holdout_local_tests_share_no_image_with_any_training_split(small_config):
    cfg = load_config(raw={**small_config, "data": {**small_config["data"], "local_test": {"source": "holdout", "fraction": 0.25},
                                                      "partition": {"kind": "classes_per_client", "k": 2, "samples_per_client": 150}}})
    fed = build_federation(cfg.data, cfg.seed)
    all_train = set(np.concatenate([t.numpy() for t in fed.train_idx]).tolist())
    for te in fed.test_idx:
        assert len(te) > 0 and not (set(te.tolist()) & all_train)


def test_test_set_local_splits_follow_client_label_distribution(small_config):
    fed = build_federation(load_config(raw=small_config).data, 3)
    train, test = fed.train_counts(), fed.test_counts()
    for k in range(fed.num_clients):
        assert set(np.flatnonzero(test[k])) <= set(np.flatnonzero(train[k]))
        assert abs(test[k].sum() - round(0.2 * train[k].sum())) <= 1


def test_config_errors_name_the_key(small_config):
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown key"):
        load_config(raw={**small_config, "train": {**small_config["train"], "lrr": 1}})
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config(raw={**small_config, "train": {**small_config["train"], "lr": -1}})
    with pytest.raises(ConfigError, match="exceeds"):
        load_config(raw={**small_config, "train": {**small_config["train"], "clients_per_round": 99}})
    with pytest.raises(ConfigError, match="unknown algorithm 'fedxyz'.*fedavg"):
        Experiment.create(load_config(raw={**small_config, "algorithm": {"name": "fedxyz"}}))
    with pytest.raises(ConfigError, match=r"algorithm\.params\.mu"):
        Experiment.create(load_config(raw={**small_config, "algorithm": {"name": "fedavg", "params": {"mu": 1}}}))
    with pytest.raises(ConfigError, match="same architecture"):
        Experiment.create(load_config(raw={**small_config, "model": {"arch": ["cnn2", "simple_cnn"]}}))


def test_config_errors_speak_of_keys_and_say_the_fix(small_config, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))

    def error(*overrides):
        with pytest.raises(ConfigError) as info:
            load_config(path, list(overrides))
        return str(info.value)

    # a union's members each say what they take, on the key's one line (no schema names)
    assert error("eval.clients=0").splitlines() == [
        f"invalid config ({path} with the overrides eval.clients=0):",
        "  eval.clients: Input should be 'all' or 'sampled'; or Input should be greater than 0"]
    assert "train.round: unknown key (did you mean rounds?)" in error("train.round=3")
    assert "train.batch-size: unknown key (did you mean batch_size?)" in error("train.batch-size=3")
    assert "model.split: expects a string or null, got false; YAML reads yes, no" in error("model.split=no")
    assert "data.local_tset: unknown key (did you mean local_test?)" in error("data.local_tset.fraction=0.1")
    # a string YAML reads as a number or a boolean: quote it
    assert """name: Input should be a valid string; YAML reads the value as the number 2024: quote it as you wrote it to keep it a string, --set 'name="..."'""" in error("name=2024")
    assert "YAML reads the value as the number 83: quote it as you wrote it" in error("name=0123")      # octal to YAML
    assert "name: expects a string, got false; YAML reads yes, no, on, off, true and false as booleans" in error("name=no")
    assert "train.rounds: expects a whole number, got true" in error("train.rounds=true")      # a section's own check, keyed
    # a date where a string goes, and null where a value goes: what YAML read, and the fix
    assert ("""name: Input should be a valid string; YAML reads 2024-01-31 as a date or time: quote it to keep it a """
            """string, --set 'name="2024-01-31"'""") in error("name=2024-01-31")
    assert ("train.lr: Input should be a valid number; YAML reads an empty value, ~ and null as null: give train.lr "
            "a value, or leave the key out for its default") in error("train.lr=~")
    # a check across sections names its keys itself
    assert error("data.pool=train+test", "data.local_test.source=test_set").splitlines()[1] == (
        "  data.pool 'train+test' leaves no separate test set: set data.local_test.source: holdout")
    with pytest.raises(ConfigError, match=r"unknown algorithm 'FedAvg' \(did you mean fedavg\?\)"):
        Experiment.create(load_config(raw={**small_config, "algorithm": {"name": "FedAvg"}}))
    with pytest.raises(ConfigError, match=r"algorithm\.params\.deltaa: unknown parameter \(did you mean delta\?\) "
                                          r"\(accepted parameters of fedrema: .*; their defaults: fedhet list fedrema\)"):
        Experiment.create(load_config(raw={**small_config, "algorithm": {"name": "fedrema", "params": {"deltaa": 1}}}))
    with pytest.raises(PartitionError, match=r"unknown partition kind 'dirichle' \(did you mean dirichlet\?\)"):
        build_federation(load_config(raw={**small_config, "data": {**small_config["data"],
                                                                   "partition": {"kind": "dirichle"}}}).data, 0)


def test_impossible_partition_is_a_clear_error(small_config):
    raw = {**small_config, "data": {**small_config["data"], "num_clients": 500, "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 10}}}
    with pytest.raises(PartitionError, match=r"dirichlet: 500 clients x min_size 10 needs at least 5000 samples "
                                             r"but there are only \d+; use fewer clients or a smaller min_size"):
        build_federation(load_config(raw=raw).data, 0)


def test_cli_run_partition_compare(small_config, tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))
    assert main(["run", str(path), "--set", "train.rounds=2", "--out", str(tmp_path / "r1"), "--no-progress"]) == 0
    assert main(["run", str(path), "--set", "train.rounds=2", "--set", "seed=5", "--out", str(tmp_path / "r2"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| tiny | fedavg | global_acc | 1 | 2 |" in out
    assert main(["compare", str(tmp_path / "r1"), str(tmp_path / "r2"), "--plot", str(tmp_path / "cmp.png")]) == 0
    out = capsys.readouterr().out
    assert "| tiny | fedavg | global_acc | 2 | 2 |" in out and "±" in out
    assert (tmp_path / "cmp.png").exists()
    assert main(["compare", str(tmp_path / "r1"), "--plot", str(tmp_path / "cmp.xyz")]) == 2      # before the table
    captured = capsys.readouterr()
    assert "matplotlib writes no .xyz files" in captured.err and captured.out == ""
    assert main(["compare", str(tmp_path / "r1"), "--plot", str(tmp_path / "bare")]) == 0
    assert f"overlay plot: {tmp_path / 'bare.png'}" in capsys.readouterr().out and (tmp_path / "bare.png").exists()
    assert main(["partition", str(path), "--out", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "6 clients" in out and (tmp_path / "p.png").exists()
    # errors come back as a message and exit code 2, not a traceback
    assert main(["run", str(path), "--set", "train.bogus=1"]) == 2
    assert "train.bogus: unknown key" in capsys.readouterr().err
    assert main(["run", str(path), "--out", str(tmp_path / "r1")]) == 2


def test_compare_prints_the_papers_number_and_the_difference(small_config, tmp_path, capsys):
    from fedhet.experiment.config import config_changes

    raw = {**small_config, "paper": {"source": "Some paper Table 1", "cell": "tiny, FedAvg", "value": 0.5,
                                     "std": 0.01, "rule": "best round"}}
    raw["train"] = {**raw["train"], "rounds": 1}
    run(raw, tmp_path / "r1")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "r1")]) == 0
    out = capsys.readouterr().out
    final = json.loads((tmp_path / "r1" / "summary.json").read_text())["metrics"]["global_acc"]["final"]
    assert f"| 50.00 ± 1.00 | {100 * final - 50:+.2f} |" in out
    assert "Some paper Table 1, tiny, FedAvg; paper's rule: best round" in out
    assert "mean of global_acc over the last 1 evaluations" in out
    edited = load_config(raw={**raw, "paper": {**raw["paper"], "value": 0.6}})
    assert config_changes(load_config(raw=raw).model_dump(mode="json"), edited) == []   # a note, not a setting
    with pytest.raises(ConfigError, match="paper.value"):
        load_config(raw={**raw, "paper": {"source": "x"}})


@pytest.mark.parametrize("measured_as, cell", [
    ("final", "| 50.00 | -10.00 |"), ("best", "| 50.00 | +5.00 (best) |"),
    ("highest:global_val_acc", "| 50.00 | +2.00 (at highest global_val_acc) |"),
    ("lowest:personal_loss", "| 50.00 | -20.00 (at lowest personal_loss) |")])
def test_compare_sets_the_paper_against_the_value_its_rule_names(small_config, tmp_path, capsys, measured_as, cell):
    """Written into the run by hand: final 40%, best 55%; three evaluated rounds of global_acc 30,
    52, 40 with validation 0.5, 0.7, 0.6 and personal loss 0.9, 1.2, 1.0. Against a paper's 50%,
    each rule picks its own number; a run shorter than the paper's T is said."""
    raw = {**small_config, "train": {**small_config["train"], "rounds": 1},
           "paper": {"source": "Some paper", "value": 0.5, "measured_as": measured_as, "rounds": 5}}
    run(raw, tmp_path / "r1")
    summary_path, metrics_path = tmp_path / "r1" / "summary.json", tmp_path / "r1" / "metrics.jsonl"
    summary = json.loads(summary_path.read_text())
    summary["metrics"]["global_acc"].update(final=0.40, best=0.55)
    summary_path.write_text(json.dumps(summary))
    rows = [{"round": r, "global_acc": acc, "global_val_acc": val, "personal_loss": loss}
            for r, acc, val, loss in ((1, 0.30, 0.5, 0.9), (2, 0.52, 0.7, 1.2), (3, 0.40, 0.6, 1.0))]
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "r1")]) == 0
    out = capsys.readouterr().out
    assert "| paper (%) | measured - paper |" in out and cell in out
    assert "ran 1 of the paper's 5 rounds, so the difference is not like for like" in out
    # a run that did not record what its rule selects by: no number, and why
    metrics_path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "global_val_acc"}) + "\n"
                                    for r in rows))
    assert main(["compare", str(tmp_path / "r1")]) == 0
    out = capsys.readouterr().out
    if measured_as == "highest:global_val_acc":
        assert "| 50.00 | - |" in out and "1 of 1 runs recorded no global_acc or no global_val_acc" in out
        assert "needs data.local_test.source: holdout" in out
    else:
        assert cell in out and "recorded no" not in out
    with pytest.raises(ConfigError, match="paper.measured_as"):
        load_config(raw={**raw, "paper": {**raw["paper"], "measured_as": "at_best_val"}})
    if measured_as == "highest:global_val_acc":
        # the summary's best-validation choice, made from every row, is the run's number where it has one
        summary["model_selection"] = {"value": 0.58, "round": 2, "validation": 0.7, "metric": "global_acc",
                                      "rule": "global_acc at the first evaluated round with the highest global_val_acc"}
        summary_path.write_text(json.dumps(summary))
        assert main(["compare", str(tmp_path / "r1")]) == 0
        assert "| 50.00 | +8.00 (at highest global_val_acc) |" in capsys.readouterr().out
    if measured_as == "best":                            # a recorded config edited by hand into nonsense
        config_path = tmp_path / "r1" / "config.yaml"
        config_path.write_text(config_path.read_text().replace("measured_as: best", "measured_as: at_best_val"))
        assert main(["compare", str(tmp_path / "r1")]) == 2
        assert "paper.measured_as 'at_best_val' is not final, best" in capsys.readouterr().err


def test_a_method_value_named_as_one_of_fedhets_metrics_is_refused_not_recorded_over_it(small_config, tmp_path,
                                                                                         monkeypatch):
    from fedhet.algorithms.fedavg import FedAvg

    monkeypatch.setattr(FedAvg, "round_metrics", lambda self, state: {"global_acc": 1.0, "fedavg_extra": 2})
    raw = {**small_config, "train": {**small_config["train"], "rounds": 2},      # round 1 is not evaluated
           "eval": {**small_config["eval"], "every": 2}}
    with pytest.raises(ConfigError, match="round_metrics returns global_acc, a name of fedhet's own metrics"):
        run(raw, tmp_path / "r1")
    assert read_metrics(tmp_path / "r1") == []                  # stopped in round 1, before any row
    # a method's values as it naturally has them (a 0-d tensor, NumPy numbers) are recorded as numbers
    monkeypatch.setattr(FedAvg, "round_metrics", lambda self, state: {
        "fedavg_extra": 2, "fedavg_norm": torch.tensor(1.5), "fedavg_np": {3: np.float32(0.25), "v": np.arange(2)}})
    run(raw, tmp_path / "r2")
    row = read_metrics(tmp_path / "r2")[-1]
    assert row["fedavg_extra"] == 2 and row["global_acc"] < 1.0
    assert row["fedavg_norm"] == 1.5 and row["fedavg_np"] == {"3": 0.25, "v": [0, 1]}
    monkeypatch.setattr(FedAvg, "round_metrics", lambda self, state: {"fedavg_when": {"at": object()}})
    with pytest.raises(ConfigError, match=r"algorithm fedavg: round_metrics\(\)\['fedavg_when'\]\['at'\] is of type object, "
                                          "which a metrics row cannot hold"):
        run(raw, tmp_path / "r3")
    from fedhet.experiment.runner import recordable  # what an array holds is checked in turn
    with pytest.raises(ConfigError, match=r"x\[1\] is of type object"):
        recordable(np.array([1, object()], dtype=object), "x")
    assert recordable(np.array([[1.5], [2.0]], dtype=np.float32), "x") == [[1.5], [2.0]]
    # every name fedhet itself wrote in the row is one a method may not take
    from fedhet.experiment.runner import is_fedhet_metric
    assert [k for k in row if not is_fedhet_metric(k)] == ["fedavg_extra", "fedavg_norm", "fedavg_np"]


def test_a_checkpoint_whose_client_states_live_with_the_clients_resumes_only_where_they_do(small_config, tmp_path,
                                                                                          monkeypatch):
    """A transport that keeps client states with its clients (a Flower deployment's SuperNodes) writes
    that into its checkpoints; the simulator, whose states are in the file, refuses to go on from one
    and names the command that can."""
    from fedhet.engine.loop import InProcess

    raw = {**small_config, "train": {**small_config["train"], "rounds": 1}}
    monkeypatch.setattr(InProcess, "keeps_client_state", True)
    run(raw, tmp_path / "r")
    (tmp_path / "r" / "summary.json").unlink()
    monkeypatch.setattr(InProcess, "keeps_client_state", False)
    with pytest.raises(CheckpointError, match=r"client states are with its clients .*: continue it with "
                                              r"`fedhet flower run --resume"):
        Experiment.resume(tmp_path / "r")
    monkeypatch.setattr(InProcess, "keeps_client_state", True)
    assert Experiment.resume(tmp_path / "r").start_round == 1         # where they are: it goes on


def test_personal_accuracy_equals_a_client_by_client_evaluation(small_config, tmp_path):
    """The evaluator batches clients and reuses the global pass; the numbers must equal the
    obvious per-client computation."""
    from fedhet.metrics.evaluate import evaluate_loop as evaluate
    from fedhet.metrics.evaluate import predict

    exp = run(small_config, tmp_path / "r")
    fed, sim = exp.federation, exp.loop
    got = evaluate(sim)
    model = sim.host.models["cnn2"]
    for cid in range(fed.num_clients):
        x, y = fed.local_test(cid)
        hits, _ = predict(model, sim.client_model(cid), x, y, fed.normalize, batch_size=7)
        assert got["personal_acc_by_client"][cid] == pytest.approx(float(hits.float().mean()), abs=1e-5)
    hits, _ = predict(model, sim.server_state["model"], fed.test.x, fed.test.y, fed.normalize, batch_size=7)
    assert got["global_acc"] == pytest.approx(float(hits.float().mean()))


def test_personalized_evaluation_holds_a_chunk_of_client_models_at_a_time(small_config, tmp_path, monkeypatch):
    """Each client's own model (Local-only) may come from a state spilled to disk: evaluation holds
    EVAL_CLIENTS_PER_CHUNK of them at once (one more while the next is read), not every client's,
    and the numbers are those of one pass over all."""
    import weakref

    from fedhet.metrics import evaluate as evaluation

    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "local"}
    raw["train"]["rounds"] = 1
    exp = run(raw, tmp_path / "r")
    loop, host = exp.loop, exp.loop.host

    class Held(dict):
        """A client's weights whose life the test can watch (a dict cannot be weakly referenced)."""

        __hash__ = object.__hash__                       # by identity, for the WeakSet

    alive: weakref.WeakSet = weakref.WeakSet()
    most = [0]

    def client_model(cid):
        most[0] = max(most[0], len(alive))
        weights = Held(loop.client_model(cid))
        alive.add(weights)
        return weights

    def metrics():
        return evaluation.evaluate(loop.algorithm, loop.server_state, client_model, host.client_models,
                                   host.client_arch, host.federation)

    whole = metrics()
    assert most[0] == 5                                  # 6 clients, one chunk: all held at once
    monkeypatch.setattr(evaluation, "EVAL_CLIENTS_PER_CHUNK", 2)
    most[0] = 0
    chunked = metrics()
    assert most[0] <= 2
    assert chunked["personal_acc_by_client"] == whole["personal_acc_by_client"]
    assert chunked["personal_loss"] == whole["personal_loss"]


def test_eval_clients_restricts_the_personalized_metrics(small_config, tmp_path, monkeypatch):
    """eval.clients: the round's sampled clients, or a fixed subset; the same numbers as 'all' for them."""
    import fedhet.experiment.runner as runner
    from fedhet.metrics.evaluate import evaluation_clients

    drawn = []          # the clients are drawn once per evaluated round, though training and evaluation ask
    monkeypatch.setattr(runner, "evaluation_clients", lambda *a: drawn.append(a) or evaluation_clients(*a))
    rows = {}
    for which in ("all", "sampled", 4):
        raw = copy.deepcopy(small_config)
        raw["eval"]["clients"] = which
        exp = Experiment.create(load_config(raw=raw), tmp_path / str(which))
        exp.run(progress=False)
        rows[which] = read_metrics(exp.run_dir)
    assert len(drawn) == 3 * len(rows["all"]) == 3 * small_config["train"]["rounds"]
    subset = evaluation_clients(4, 6, [], small_config["seed"])
    assert len(subset) == 4 and subset == evaluation_clients(4, 6, [0], small_config["seed"])
    for everyone, sampled, fixed in zip(rows["all"], rows["sampled"], rows[4]):
        assert everyone["personal_clients"] == 6 and sampled["personal_clients"] == 3 and fixed["personal_clients"] == 4
        for row, chosen in ((sampled, sorted(sampled["clients"])), (fixed, subset)):
            by = row["personal_acc_by_client"]              # as metrics.jsonl holds it: the tested clients
            assert [int(c) for c in by] == chosen
            assert all(by[str(c)] == everyone["personal_acc_by_client"][str(c)] for c in chosen)
            assert row["personal_acc"] == pytest.approx(np.mean([by[str(c)] for c in chosen]), abs=1e-5)
        assert sampled["global_acc"] == everyone["global_acc"]
    with pytest.raises(ConfigError, match="eval.clients"):
        raw = copy.deepcopy(small_config)
        raw["eval"]["clients"] = "some"
        load_config(raw=raw)


def test_fedavg_without_a_global_test_set_headlines_personal_accuracy(small_config):
    # FedReMa's protocol pools train+test: FedAvg's global model is tested on the clients' local splits.
    small_config["data"].update(pool="train+test", local_test={"source": "holdout", "fraction": 0.2})
    small_config["train"]["rounds"] = 1
    exp = Experiment.create(load_config(raw=small_config))
    summary = exp.run(progress=False)
    assert summary["headline_metric"] == "personal_acc" and summary["headline"]["best"] > 0
    assert "global_acc" not in read_metrics(exp.run_dir)[0]


def test_resume_accepts_a_checkpoint_made_before_a_config_key_existed(small_config):
    """Keys added to the config later (eval.clients, train.optimizer/betas) are absent from older
    checkpoints: at their default they are no change; set to something else they are."""
    from fedhet.experiment.config import config_changes

    cfg = load_config(raw=small_config)
    recorded = cfg.model_dump(mode="json")
    del recorded["eval"]["clients"], recorded["train"]["optimizer"], recorded["train"]["betas"]
    assert config_changes(recorded, cfg) == []
    changed = load_config(raw={**small_config, "eval": {**small_config["eval"], "clients": "sampled"}})
    assert config_changes(recorded, changed) == ["eval.clients: '<absent>' -> 'sampled'"]


def test_a_run_may_resume_on_another_device_but_not_in_another_precision(small_config):
    """A sweep stopped on a lent GPU goes on on a CPU (benchmarks/gpu_sweeps.sh): run.device and how
    the device runs it (cuda_graphs, client_state) may change on resume; run.precision may not."""
    from fedhet.experiment.config import config_changes

    on_gpu = {**small_config.get("run", {}), "device": "cuda", "cuda_graphs": False, "client_state": "device"}
    recorded = load_config(raw={**small_config, "run": on_gpu}).model_dump(mode="json")
    assert config_changes(recorded, load_config(raw=small_config)) == []
    bf16 = load_config(raw={**small_config, "run": {**on_gpu, "precision": "bf16"}})
    assert config_changes(recorded, bf16) == ["run.precision: 'fp32' -> 'bf16'"]


@pytest.mark.parametrize("name", ["scaffold", "fednova", "fedprox+scaffold"])
def test_sgd_derived_server_rules_refuse_adam(small_config, name):
    from fedhet.experiment.build import make_algorithm

    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": name, "params": {"mu": 0.01} if "fedprox" in name else {}}
    assert make_algorithm(load_config(raw=raw)).requires_sgd
    raw["train"]["optimizer"] = "adam"
    with pytest.raises(ConfigError, match="train.optimizer must be sgd, not adam"):
        make_algorithm(load_config(raw=raw))
    raw["algorithm"] = {"name": "fedavg"}
    assert make_algorithm(load_config(raw=raw)).name == "fedavg"          # Adam is fine elsewhere
    # momentum kept across rounds: not counted by their server rules
    raw["algorithm"] = {"name": name, "params": {"mu": 0.01} if "fedprox" in name else {}}
    raw["train"].update(optimizer="sgd", momentum=0.9, optimizer_state="keep")
    with pytest.raises(ConfigError, match="optimizer_state: reset"):
        make_algorithm(load_config(raw=raw))
    raw["train"]["optimizer_state"] = "reset"
    assert make_algorithm(load_config(raw=raw)).requires_sgd


def test_auto_optimizer_state_with_a_method_that_keeps_it_is_refused_for_sgd_derived_server_rules(small_config):
    """scaffold+fedrema: FedReMa keeps each client's optimizer state under train.optimizer_state
    auto, so SCAFFOLD's control variates would meet momentum from earlier rounds; the check reads
    the policy as the client host does."""
    from helpers import build_loop

    from fedhet.experiment.build import make_algorithm

    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "scaffold+fedrema"}
    raw["train"].update(optimizer="sgd", momentum=0.9, optimizer_state="auto")
    with pytest.raises(ConfigError, match="train.optimizer_state: auto, which keeps it"):
        make_algorithm(load_config(raw=raw))
    raw["train"]["momentum"] = 0.0                       # nothing carried that the rule does not count
    assert build_loop(load_config(raw=raw)).host.keeps_optimizer_state
    raw["train"].update(momentum=0.9, optimizer_state="reset")
    assert not build_loop(load_config(raw=raw)).host.keeps_optimizer_state


def test_eval_clients_needs_personalized_metrics(small_config):
    raw = copy.deepcopy(small_config)
    raw["eval"] = {**raw["eval"], "clients": "sampled", "personalized": False}
    with pytest.raises(ConfigError, match="eval.clients"):
        load_config(raw=raw)


def test_cli_threads_is_the_runs_cpu_budget(small_config, tmp_path, monkeypatch):
    """``fedhet run --threads 1`` (what a sweep lane passes) caps the cores engine: auto plans for,
    so a lane never forks workers beside the other lanes; on --resume it replaces run.threads."""
    import yaml

    import fedhet.engine as engine_module

    monkeypatch.setattr(engine_module, "usable_cpus", lambda: 4)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))
    assert main(["run", str(path), "--set", "train.rounds=2", "--threads", "1", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 0
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["run"]["threads"] == 1
    engine = json.loads((tmp_path / "r" / "summary.json").read_text())["engine"]
    assert engine["engine"] == "reference" and "1 CPU(s) of run.threads" in engine["reason"], engine
    main(["run", str(path), "--set", "train.rounds=2", "--out", str(tmp_path / "free"), "--no-progress"])
    assert "run.threads" not in json.loads((tmp_path / "free" / "summary.json").read_text())["engine"]["reason"]
    # a resume with another budget: allowed (speed only), and the engine plans for it
    (tmp_path / "r" / "summary.json").unlink()
    exp = Experiment.resume(tmp_path / "r", threads=3)
    assert exp.cfg.run.threads == 3 and exp.engine_choice is not None and "1 CPU(s)" not in exp.engine_choice.reason
    with pytest.raises(SystemExit):
        main(["run", str(path), "--threads", "0"])


def test_a_whole_run_in_a_fresh_process_never_imports_dynamo(small_config, tmp_path):
    """`fedhet run` (build, a round of training, aggregation, evaluation, checkpoint, summary,
    plot) must not pull in torch._dynamo, which costs every Flower ClientApp process seconds:
    torch.optim's step and several torch helpers import it on first use."""
    import subprocess
    import sys

    import yaml

    small_config["train"]["rounds"] = 2
    small_config["run"]["checkpoint_every"] = 1
    small_config["run"]["engine"] = "reference"     # training in this process, where sys.modules is read
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(small_config))
    code = ("import sys\nfrom fedhet.cli import main\n"
            f"rc = main(['run', {str(path)!r}, '--no-progress'])\n"
            "assert rc == 0, rc\n"
            "print('dynamo imported' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no dynamo", out.stdout[-2000:]


def test_compare_says_when_runs_differ_in_precision(small_config, tmp_path):
    import shutil

    from fedhet.experiment.report import compare_table

    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 1
    run(raw, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    (tmp_path / "b" / "summary.json").write_text(json.dumps({**summary, "seed": summary["seed"] + 1}))  # a 2nd seed
    table, _ = compare_table([tmp_path / "a", tmp_path / "b"])
    assert "precision" not in table
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    (tmp_path / "b" / "summary.json").write_text(json.dumps({**summary, "eval_precision": "bf16", "precision": "bf16"}))
    table, _ = compare_table([tmp_path / "a", tmp_path / "b"])
    assert "Not every run has the same precision (trained / evaluated): tiny: bf16 / bf16, fp32 / fp32" in table


def test_settings_changed_from_a_paper_config_are_recorded_and_said_beside_the_paper(small_config, tmp_path,
                                                                                     capsys):
    """--set on a config that states a paper's number: what changes the experiment is kept in the
    paper section (how the run is carried out, its evaluation, seed, name and rounds are not), and
    compare says the difference is not like for like."""
    raw = {**small_config, "paper": {"source": "Some paper", "value": 0.5}}
    overrides = ["data.num_clients=5", "train.clients_per_round=2", "algorithm.params.bn_buffers=local",
                 "train.lr=0.05", "run.threads=1", "eval.final_window=1", "seed=4", "name=other",
                 "train.rounds=1", "data.download=false"]         # train.lr as the config has it: no change
    cfg = load_config(raw=copy.deepcopy(raw), overrides=overrides)
    assert cfg.paper.changed == ["algorithm.params.bn_buffers", "data.num_clients", "train.clients_per_round"]
    assert load_config(raw=copy.deepcopy(raw), overrides=["train.rounds=1", "run.threads=1"]).paper.changed == []
    assert load_config(raw=copy.deepcopy(small_config), overrides=["data.num_clients=5"]).paper is None
    Experiment.create(cfg, tmp_path / "r").run(progress=False)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "r")]) == 0
    assert ("run with algorithm.params.bn_buffers, data.num_clients, train.clients_per_round changed from the config "
            "that states the paper's number, so the difference is not like for like") in capsys.readouterr().out
