"""Bad input gets a clear error that names the setting and the fix (or a warning, or it works):
each case here once crashed with a raw traceback, ran silently as something else, or misled."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from helpers import module_of_ones_own, small_config_in

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.fedavg import FedAvg
from fedhet.cli import main
from fedhet.core.errors import CheckpointError, ConfigError, DataError, PartitionError
from fedhet.core.split import BODY, select
from fedhet.data.federated import build_federation
from fedhet.experiment.build import build, build_models, make_algorithm
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.experiment.yaml_io import parse_yaml


def cfg_of(small_config, **sections):
    raw = copy.deepcopy(small_config)
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section].update(values)
        else:
            raw[section] = values
    return raw


# --- crashes that are now errors ------------------------------------------------------------
def test_a_model_too_large_for_memory_is_a_config_error(small_config):
    cfg = load_config(raw=cfg_of(small_config, model={"arch": "cnn2", "options": {"projection_dim": 10**12}}))
    with pytest.raises(ConfigError, match=r"model cnn2 could not be built .*projection_dim or width of that size does "
                                          r"not fit in memory"):
        build_models(cfg, build_federation(cfg.data, cfg.seed))


@pytest.mark.parametrize("method,model,message", [
    ("fedrod", {"arch": "cnn2", "split": "fc1"}, r"FedROD needs a linear classifier: model cnn2's head \(from model.split on\) "
                                                 r"must be a single Linear layer; set model.split to the stage of its last "
                                                 r"Linear layer \('fc2'\)"),
    ("fedprox+fedrod", {"arch": "cnn2", "split": "fc1"}, r"FedROD needs a linear classifier: model cnn2's head"),
    ("fedrs", {"arch": ["cnn2", "fca_tiny_a"]}, r"FedRS needs a linear classifier: model fca_tiny_a's head applies ReLU "
                                                r"besides its Linear"),
    ("creff", {"arch": "cnn2", "split": "fc1"}, r"CReFF needs a linear classifier: model cnn2's head \(from model.split on\)"),
    ("fednh", {"arch": "cnn2"}, r"FedNH's class prototypes are a bias-free classifier, and model cnn2's head has a bias"),
    ("fednh", {"arch": "cnn2", "split": "fc1"}, r"FedNH needs a linear classifier: .*\('fc2'\).*; its Linear must also "
                                                r"have no bias \(simple_cnn: model.split fc3\)$"),
    ("fedproto", {"arch": "fca_tiny_a"}, r"FedProto's nearest-prototype evaluation needs a linear classifier: model "
                                         r"fca_tiny_a's head applies ReLU .*relu_features: true.*; or evaluate each client with its own "
                                         r"classifier: algorithm.params.proto_eval: classifier$"),
    ("fedproto", {"arch": "simple_cnn"}, r"FedProto's nearest-prototype evaluation puts -\|\|C_c\|\|\^2 in the "
                                         r"classifier's bias, and model simple_cnn's head has none"),
], ids=["fedrod_deep", "fedprox+fedrod_deep", "fedrs_relu", "creff_deep", "fednh_bias", "fednh_deep", "fedproto_relu",
        "fedproto_no_bias"])
def test_a_method_refuses_a_head_it_cannot_use_before_round_1(small_config, tmp_path, method, model, message):
    """Algorithm.check_model, called once per architecture when the client host is made: these failed in round 1
    (FedROD, CReFF), trained a model other than the one evaluated (an activation before the Linear), or
    evaluated with another rule under a warning (FedProto)."""
    cfg = load_config(raw=cfg_of(small_config, algorithm={"name": method}, model=model))
    with pytest.raises(ConfigError, match=message):
        Experiment.create(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()      # refused before any round trained


def test_fedproto_evaluating_with_the_classifier_takes_any_head(small_config, tmp_path):
    cfg = load_config(raw=cfg_of(small_config, algorithm={"name": "fedproto", "params": {"proto_eval": "classifier"}},
                                 model={"arch": "fca_tiny_a"}, train={"rounds": 1}))
    assert Experiment.create(cfg, tmp_path / "run").run(progress=False)["rounds_completed"] == 1


def test_run_device_is_checked_against_this_machine(small_config, monkeypatch, tmp_path):
    """An unknown device is refused at load; a CUDA device the machine lacks when the run is built
    (it crashed in the first training step); auto picks CUDA only where torch sees it."""
    from fedhet.experiment.build import resolve_device

    with pytest.raises(ConfigError, match="run.device: expected cpu, cuda, cuda:N or auto, got 'gpu'"):
        load_config(raw=cfg_of(small_config, run={"device": "gpu"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="run.device: cuda, but torch .* sees no CUDA device"):
        Experiment.create(load_config(raw=cfg_of(small_config, run={"device": "cuda"})), tmp_path / "cuda")
    assert not (tmp_path / "cuda" / "metrics.jsonl").exists()
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    exp = Experiment.create(load_config(raw=cfg_of(small_config, run={"device": "auto"}, train={"rounds": 1})),
                            tmp_path / "auto")
    assert exp.run(progress=False)["device"] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(ConfigError, match=r"cuda:1, but this machine has 1 CUDA device\(s\) \(cuda:0 to cuda:0\)"):
        resolve_device("cuda:1")


def test_an_empty_architecture_list_is_a_config_error(small_config):
    with pytest.raises(ConfigError, match="model.arch must name an architecture"):
        load_config(raw=cfg_of(small_config, model={"arch": []}))


def test_a_set_value_that_is_not_yaml_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--set train.rounds=\[1: the value is not valid YAML"):
        load_config(overrides=["train.rounds=[1"])


def test_a_mapping_set_on_a_section_would_drop_its_keys_and_is_refused(small_config, tmp_path):
    import fedhet

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config))
    # it replaced the file's whole train section: lr, batch_size... went back to their defaults
    with pytest.raises(ConfigError, match=r"--set train=\{rounds: 1\} would replace the whole train section, putting "
                                          r"batch_size, clients_per_round, local_epochs, lr \(set in the config\)"):
        load_config(path, ["train={rounds: 1}"])
    with pytest.raises(ConfigError, match="whole data.local_test section, putting fraction .* back to its default"):
        fedhet.run(str(path), {"data.local_test": {"source": "holdout"}}, out=tmp_path / "a")
    assert not (tmp_path / "a").exists()
    # a value that keeps every key the file set, a section the file lacks, and one value's mapping are fine
    assert load_config(path, ["train={rounds: 1, clients_per_round: 3, local_epochs: 1, batch_size: 32, lr: 0.05}"]
                       ).train.rounds == 1
    normalize = load_config(path, ["data.normalize={mean: [0.5], std: [0.5]}"]).data.normalize
    assert (list(normalize.mean), list(normalize.std)) == ([0.5], [0.5])
    assert load_config(path, ["data.partition={kind: iid}"]).data.partition.options() == {}


@pytest.mark.parametrize("key", ["", "train.", ".rounds", "train..rounds"])
def test_a_set_key_with_an_empty_name_is_refused(key):
    with pytest.raises(ConfigError, match=f"the key '{re.escape(key)}' has an empty name"):
        load_config(overrides=[f"{key}=1"])


def test_python_overrides_name_a_key_holding_an_assignment_and_a_section_given_a_number(small_config, tmp_path):
    import fedhet

    with pytest.raises(ConfigError, match="key 'train.lr=0.1' holds '='"):
        fedhet.run(small_config, {"train.lr=0.1": 1}, out=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"algorithm.params: expects a mapping of settings, got 3; .* "
                                          r"algorithm.params.<setting> in --set"):
        fedhet.run(small_config, {"algorithm.params": 3}, out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- what used to pass silently ----------------------------------------------------------------
def test_two_processes_cannot_write_one_run_directory(small_config, tmp_path):
    cfg = load_config(raw=small_config)
    first = Experiment.create(cfg, tmp_path / "run")            # holds the folder until its run ends
    with pytest.raises(ConfigError, match="in use by another fedhet process"):
        Experiment.resume(tmp_path / "run")
    first.run(progress=False)
    Experiment.resume(tmp_path / "run").run(progress=False)     # free again once the run ended


def test_default_run_directories_of_one_second_do_not_collide(small_config, monkeypatch):
    from fedhet.experiment import runner

    monkeypatch.setattr(runner.time, "strftime", lambda *args: "20260101-000000")    # one second
    cfg = load_config(raw=cfg_of(small_config, train={"rounds": 1}))
    a = Experiment.create(cfg)
    a.run(progress=False)
    b = Experiment.create(cfg)
    assert a.run_dir != b.run_dir


def test_a_key_given_twice_in_a_yaml_file_is_an_error(small_config, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small_config) + "train: {rounds: 1}\n")
    with pytest.raises(ConfigError, match="the key 'train' appears twice"):
        load_config(path)


def test_a_yaml_error_names_the_files_line_and_column_and_a_tab_gets_its_fix(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ntrain:\n\trounds: 2\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    first = str(caught.value).splitlines()[0]
    assert first == (f"{path} is not valid YAML: line 3, column 1: found character '\\t' that cannot start any "
                     "token (while scanning for the next token); YAML indents with spaces, not tabs")
    assert "unicode string" not in str(caught.value)
    path.write_text("name: x\ntrain: {rounds: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml is not valid YAML: line 3, column 1: expected ',' or '}'"):
        load_config(path)


def test_numbers_in_exponent_form_are_numbers():
    assert parse_yaml("a: 5e-1\nb: 1e3\nc: 1.5e-2\nd: 2e") == {"a": 0.5, "b": 1000.0, "c": 0.015, "d": "2e"}


def test_exponent_partition_parameters_reach_the_partitioner(small_config, tmp_path):
    raw = cfg_of(small_config, data={"partition": {"kind": "dirichlet", "alpha": 5.0, "min_size": 20}})
    text = yaml.safe_dump(raw).replace("alpha: 5.0", "alpha: 5e-1")
    assert "alpha: 5e-1" in text
    (tmp_path / "c.yaml").write_text(text)
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.data.partition.options()["alpha"] == 0.5
    build_federation(cfg.data, cfg.seed)


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_number_of_rounds(small_config, value):
    with pytest.raises(ConfigError, match=f"rounds: expects a whole number, got {str(value).lower()}"):
        load_config(raw=cfg_of(small_config, train={"rounds": value}))


def test_fedfm_whose_warm_up_outlasts_the_run_is_refused(small_config):
    with pytest.raises(ConfigError, match=r"start_round \(20.*train.rounds \(3\)"):
        make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedfm"})))
    make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedfm", "params": {"start_round": 2}})))


def test_fedcme_with_one_local_epoch_is_refused_unless_nothing_is_exchanged(small_config):
    with pytest.raises(ConfigError, match="train.local_epochs to 2 or more"):
        make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedcme"})))
    make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedcme", "params": {"exchange": "none"}})))
    make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedcme"}, train={"local_epochs": 2})))


def test_more_architectures_than_clients_is_refused(small_config):
    with pytest.raises(ConfigError, match="model.arch lists 7 architectures for 6 clients"):
        load_config(raw=cfg_of(small_config, model={"arch": ["fca_cnn_a"] * 7}))


def test_grouped_dominant_with_more_groups_than_clients_is_refused(small_config):
    raw = cfg_of(small_config, data={"num_clients": 3, "partition": {"kind": "grouped_dominant",
                                                                      "samples_per_client": 50, "s": 0.2}})
    raw["train"]["clients_per_round"] = 3
    cfg = load_config(raw=raw)
    with pytest.raises(PartitionError, match=r"5 label groups but only 3 clients, so groups \[\[4, 5, 6\], \[8, 9, 0\]\]"):
        build_federation(cfg.data, cfg.seed)


def test_a_batch_larger_than_every_client_with_drop_last_is_refused(small_config, tmp_path):
    raw = cfg_of(small_config, train={"batch_size": 10**5, "drop_last": True, "rounds": 1})
    with pytest.raises(ConfigError, match=r"train.batch_size \(100000\) exceeds every client's training data .* "
                                          "set train.drop_last: false"):
        Experiment.create(load_config(raw=raw), tmp_path / "r")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    raw["train"]["drop_last"] = False                       # one short batch each: it trains
    assert Experiment.create(load_config(raw=raw), tmp_path / "s").run(progress=False)["status"] == "completed"


def test_clients_smaller_than_a_batch_with_drop_last_are_named_in_a_warning(small_config, tmp_path):
    raw = cfg_of(small_config, train={"drop_last": True, "rounds": 1})
    cfg = load_config(raw=raw)
    sizes = build_federation(cfg.data, cfg.seed).train_counts().sum(axis=1)
    # a batch size between the smallest and the largest client: some clients train, some cannot
    raw["train"]["batch_size"] = int(sorted(sizes)[len(sizes) // 2]) + 1
    short = [c for c, n in enumerate(sizes) if n < raw["train"]["batch_size"]]
    assert 0 < len(short) < len(sizes)
    with pytest.warns(UserWarning, match=rf"{len(short)} of {len(sizes)} clients hold fewer training samples than "
                                         rf"train.batch_size .* \(clients {short[0]}, "):
        Experiment.create(load_config(raw=raw), tmp_path / "r")
    raw["train"]["drop_last"] = False                       # every client trains: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Experiment.create(load_config(raw=raw), tmp_path / "s")


# --- messages that misled ------------------------------------------------------------------------
def test_an_empty_client_is_named_as_such_with_test_set_local_splits(small_config):
    raw = cfg_of(small_config, data={"num_clients": 400, "partition": {"kind": "dirichlet", "alpha": 0.05,
                                                                        "min_size": 0}})
    cfg = load_config(raw=raw)
    with pytest.raises(PartitionError, match=r"client \d+ received no training samples"):
        build_federation(cfg.data, cfg.seed)


def test_an_empty_client_of_a_users_partition_names_it_and_the_images_it_split(small_config, tmp_path, monkeypatch):
    """The partition function is the cause, and data.pool_fraction's count is of the images kept."""
    module_of_ones_own(tmp_path, monkeypatch, "lab_empty",
                       "import numpy as np\nSEEN = []\n\n\ndef leave_one_empty(labels, num_clients, rng):\n"
                       "    SEEN.append(len(labels))\n"
                       "    return [*np.array_split(np.arange(len(labels)), num_clients - 1), np.array([], dtype=int)]\n")
    import lab_empty

    for source in ("test_set", "holdout"):
        raw = cfg_of(small_config, data={"partition": {"kind": "lab_empty:leave_one_empty"}, "pool_fraction": 0.5,
                                          "local_test": {"source": source, "fraction": 0.2}})
        cfg = load_config(raw=raw)
        with pytest.raises(PartitionError) as info:
            build_federation(cfg.data, cfg.seed)
        kept = lab_empty.SEEN[-1]
        assert str(info.value).startswith("client 5 received no training samples from partition "
                                          "'lab_empty:leave_one_empty'; use fewer clients or another partition")
        assert f"data.pool_fraction 0.5 keeps {kept} images for 6 clients (about {kept // 6} each)" in str(info.value)


def test_an_undrawable_local_test_split_names_data_local_test(small_config):
    raw = cfg_of(small_config, data={"num_clients": 2, "partition": {"kind": "iid"},
                                      "local_test": {"source": "test_set", "fraction": 0.9}})
    raw["train"]["clients_per_round"] = 2
    cfg = load_config(raw=raw)
    with pytest.raises(PartitionError, match=r"data.local_test \(source test_set, fraction 0.9\): client 0") as info:
        build_federation(cfg.data, cfg.seed)
    assert "draw with replacement as FedClassAvg's code does (data.local_test.replace: true)" in str(info.value)
    raw["data"]["local_test"]["replace"] = True        # the fix the message names builds the federation
    fed = build_federation(load_config(raw=raw).data, cfg.seed)
    assert len(fed.test_idx[0]) == round(0.9 * len(fed.train_idx[0]))
    raw["data"]["local_test"]["source"] = "holdout"
    with pytest.raises(ConfigError, match="data.local_test.replace draws from the global test set: it needs"):
        load_config(raw=raw)


def test_a_flower_run_that_died_before_its_first_checkpoint_says_how_to_go_on(tmp_path):
    from fedhet.flower.deploy import resume_hint

    assert "give the same command again" in resume_hint(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    assert f"fedhet flower run --resume {tmp_path}` starts the run again from round 1" in resume_hint(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert "the rounds done are kept" in resume_hint(tmp_path)


def test_a_failed_run_says_the_error_its_apps_logged(tmp_path):
    """A ServerApp that fails before it writes a summary (here: the user's method cannot be imported
    where it runs) is reported with its exception's line, not only 'see the logs'."""
    from fedhet.flower.deploy import logged_error

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "supernode-0.log").write_text("INFO: waiting\nValueError: a node's own failure\n")
    assert logged_error(logs) == f"ValueError: a node's own failure (in {logs / 'supernode-0.log'})"
    (logs / "run.log").write_text(
        "Traceback (most recent call last):\n  File \"app.py\", line 3, in main\n"
        "fedhet.core.errors.ConfigError: algorithm.name: 'feddamp:FedDamp': no module 'feddamp' can be imported\n"
        "\x1b[91mERROR \x1b[0m:     Exit Code: 201\n")
    assert logged_error(logs) == ("fedhet.core.errors.ConfigError: algorithm.name: 'feddamp:FedDamp': no module "
                                  f"'feddamp' can be imported (in {logs / 'run.log'})")
    (logs / "run.log").write_text("nothing went wrong here\n")
    (logs / "supernode-0.log").unlink()
    assert logged_error(logs) is None


# --- fedhet compare ------------------------------------------------------------------------------
def _run(raw, out, **train):
    raw = copy.deepcopy(raw)
    raw["train"].update(rounds=1, **train)
    Experiment.create(load_config(raw=raw), out).run(progress=False)


@pytest.fixture(scope="module")
def two_runs_once(synth_root, tmp_path_factory):
    """Two one-round runs (seeds 3 and 4), trained once for this module's tests, which damage copies."""
    base = tmp_path_factory.mktemp("two_runs")
    raw = small_config_in(synth_root, base / "runs")
    _run(raw, base / "a")
    _run(cfg_of(raw, seed=4), base / "b")
    return base / "a", base / "b"


@pytest.fixture
def two_runs(two_runs_once, tmp_path):
    copies = tmp_path / "a", tmp_path / "b"
    for made, copy_ in zip(two_runs_once, copies):
        shutil.copytree(made, copy_)
    return copies


@pytest.mark.parametrize("left", ["config.yaml", "summary.json", "checkpoint.pt"])
def test_a_run_folder_that_lost_its_metrics_is_still_a_run_and_never_written_over(small_config, two_runs, left,
                                                                                   capsys):
    """--out on a run folder whose metrics.jsonl is gone (a bad copy, a merge): any of the run's own
    files marks it, and the new run is refused before anything is written."""
    a, _ = two_runs
    (a / "metrics.jsonl").unlink()
    for name in {"config.yaml", "summary.json", "checkpoint.pt"} - {left}:
        (a / name).unlink()
    before = {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()}
    path = a.parent / "new.yaml"
    path.write_text(yaml.safe_dump(cfg_of(small_config, train={"lr": 0.07})))
    assert main(["run", str(path), "--out", str(a)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()} == before


def test_compare_refuses_one_run_given_twice(two_runs, capsys):
    a, _ = two_runs
    assert main(["compare", str(a), str(a)]) == 2
    assert "is given twice" in capsys.readouterr().err


def test_compare_refuses_to_pool_different_algorithms_under_one_name(small_config, two_runs, tmp_path, capsys):
    a, _ = two_runs
    _run(cfg_of(small_config, seed=5, algorithm={"name": "fedprox", "params": {"mu": 0.01}}), tmp_path / "c")
    assert main(["compare", str(a), str(tmp_path / "c")]) == 2
    assert "ran different algorithms" in capsys.readouterr().err


def test_compare_leaves_failed_runs_out_and_says_so(two_runs, capsys):
    a, b = two_runs
    summary = json.loads((b / "summary.json").read_text())
    (b / "summary.json").write_text(json.dumps({**summary, "status": "failed", "error": "boom"}))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| tiny | fedavg | global_acc | 1 |" in out and f"Left out (not completed): {b} (failed: boom)" in out


def test_compare_leaves_out_a_run_without_a_summary_yet_saying_whether_it_goes_on(two_runs, capsys):
    """`fedhet compare runs/S/*` while a sweep runs: a run going on, or one killed before its summary."""
    from fedhet.experiment.rundir import RunDir

    a, b = two_runs
    (b / "summary.json").unlink()                        # killed (SIGKILL) before writing it
    assert main(["compare", str(a), str(b)]) == 0
    rows = len(read_metrics(b))
    assert (f"Left out (not completed): {b} (no summary yet: {rows} round(s) recorded; stopped before its summary: "
            f"fedhet run --resume {b}, or fedhet flower run --resume for a Flower run)") in capsys.readouterr().out
    going_on = RunDir(b)
    going_on.lock()                                      # as the process writing it holds it
    try:
        assert main(["compare", str(a), str(b)]) == 0
        assert f"(no summary yet: {rows} round(s) recorded; going on, pid {os.getpid()})" in capsys.readouterr().out
    finally:
        going_on.unlock()


def test_compare_leaves_out_the_files_a_glob_over_a_folder_of_runs_matches(two_runs, capsys):
    a, b = two_runs                                   # both in one folder, as a sweep's runs are
    (a.parent / "a.log").write_text("a log\n")
    (a.parent / "sweep.md").write_text("# a table\n")
    assert main(["compare", str(a), str(a.parent / "a.log"), str(b), str(a.parent / "sweep.md")]) == 0
    captured = capsys.readouterr()
    assert "| tiny | fedavg | global_acc | 2 |" in captured.out
    assert f"left out 2 file(s), not run directories: {a.parent / 'a.log'}, {a.parent / 'sweep.md'}" in captured.err
    # the folder itself: its runs are named
    assert main(["compare", str(a.parent)]) == 2
    assert f"{a.parent} is a folder of runs (a, b), not a run: name its runs, e.g. {a.parent}/*" in capsys.readouterr().err
    assert main(["compare", str(a.parent / "a.log")]) == 2          # no run beside it: the error says what it is
    assert "a.log is a file, not a run directory" in capsys.readouterr().err


def test_compare_says_which_pooled_runs_did_not_finish(two_runs, capsys):
    """An interrupted run counts as a seed with the rounds it has; the notes say so, with how far it got."""
    a, b = two_runs
    summary = json.loads((b / "summary.json").read_text())
    (b / "summary.json").write_text(json.dumps({**summary, "status": "interrupted", "rounds_planned": 100}))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| tiny | fedavg | global_acc | 2 |" in out
    assert f"Not finished, counted with the rounds they have (their final is not the planned run's): {b} " \
           "(interrupted, 1 of 100 rounds)" in out and str(a) + " (" not in out


def test_compare_refuses_a_metric_no_run_recorded(two_runs, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b), "--metric", "global_accc"]) == 2
    err = capsys.readouterr().err
    assert ("--metric global_accc: no such metric (did you mean global_acc?); the runs' summaries hold: "
            "global_acc") in err
    assert main(["compare", str(a), str(b), "--metric", "global_loss"]) == 2       # a row's metric, said where it is
    assert "any other, such as a loss, is in each round's row of metrics.jsonl: fedhet.load(RUN_DIR).metric(" \
           "'global_loss')" in capsys.readouterr().err


def test_compare_refuses_to_pool_runs_that_differ_in_more_than_the_seed(small_config, two_runs, tmp_path, capsys):
    a, b = two_runs
    assert main(["compare", str(a), str(b)]) == 0          # seeds 3 and 4 of one experiment
    capsys.readouterr()
    _run(cfg_of(small_config, seed=5), tmp_path / "c", lr=0.01)
    assert main(["compare", str(a), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "differ in more than the seed" in err and "train.lr: 0.05 in" in err and "0.01 in" in err
    # a run recorded before a key existed reads it as its default: still one experiment
    recorded = yaml.safe_load((b / "config.yaml").read_text())
    del recorded["eval"]["local_risk"]
    (b / "config.yaml").write_text(yaml.safe_dump(recorded))
    assert main(["compare", str(a), str(b)]) == 0
    capsys.readouterr()
    (b / "config.yaml").unlink()
    assert main(["compare", str(a), str(b)]) == 2
    assert "has no readable config.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", '{"name": "tiny", "met', "[1, 2]"], ids=["empty", "cut", "not-a-summary"])
def test_compare_names_a_damaged_summary_and_how_to_go_on(two_runs, capsys, content):
    a, b = two_runs
    (b / "summary.json").write_text(content)
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{b / 'summary.json'} is" in err and ("damaged" in err or "not a fedhet run summary" in err)
    assert "Traceback" not in err


def test_compare_says_which_runs_it_cannot_plot(two_runs, capsys):
    a, b = two_runs
    rows = [{k: v for k, v in r.items() if k != "global_acc"} for r in read_metrics(b)]
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", str(a), str(b)]) == 0
    assert f"not in the plot: {b} (its rows record no global_acc)" in capsys.readouterr().out
    (b / "metrics.jsonl").unlink()
    assert main(["compare", str(a), str(b)]) == 0
    assert f"not in the plot: {b} (no readable metrics.jsonl rows)" in capsys.readouterr().out


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.update(seed="x"), "seed is 'x', not a whole number"),
    (lambda s: s.pop("algorithm"), "it has no algorithm"),
    (lambda s: s.update(metrics=5), "metrics is 5, not a mapping"),
    (lambda s: s.pop("headline_metric"), "it has no headline_metric"),
    (lambda s: s["metrics"].update(global_acc={"final": "x"}), "metrics.global_acc has no numeric final and best"),
], ids=["seed", "algorithm", "metrics", "headline", "final"])
def test_compare_names_a_summary_field_it_cannot_read(two_runs, capsys, edit, message):
    a, b = two_runs
    summary = json.loads((b / "summary.json").read_text())
    edit(summary)
    (b / "summary.json").write_text(json.dumps(summary))
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{b / 'summary.json'} is damaged ({message})" in err and "Traceback" not in err


def test_compare_names_a_run_directory_that_is_missing_or_a_file(two_runs, tmp_path, capsys):
    a, _ = two_runs
    assert main(["compare", str(a), str(tmp_path / "nothere")]) == 2
    assert "nothere does not exist" in capsys.readouterr().err
    assert main(["compare", str(a), str(a / "config.yaml")]) == 2
    assert "config.yaml is a file, not a run directory" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"\xff\xfe garbage\n", b"5\n[1]\n", b'{"x": 1}\n'],
                         ids=["not-utf8", "not-a-mapping", "no-round"])
def test_compare_reads_a_damaged_metrics_file_as_far_as_it_is_intact(two_runs, capsys, content):
    a, b = two_runs
    intact = (b / "metrics.jsonl").read_bytes()
    (b / "metrics.jsonl").write_bytes(content)
    assert main(["compare", str(a), str(b)]) == 0
    assert f"not in the plot: {b} (no readable metrics.jsonl rows)" in capsys.readouterr().out
    (b / "metrics.jsonl").write_bytes(intact + content)          # damage after the rows: all of them plotted
    assert main(["compare", str(a), str(b)]) == 0
    assert "metrics.jsonl" not in capsys.readouterr().out


def test_compare_says_when_a_curve_stops_before_the_rounds_the_summary_counts(small_config, tmp_path, capsys):
    Experiment.create(load_config(raw=cfg_of(small_config, train={"rounds": 2})), tmp_path / "a").run(progress=False)
    rows = (tmp_path / "a" / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "a" / "metrics.jsonl").write_bytes(rows[0] + b'{"round": 2, "glob')
    assert main(["compare", str(tmp_path / "a")]) == 0
    assert f"{tmp_path / 'a'} (rows up to round 1 of 2)" in capsys.readouterr().out


@pytest.mark.parametrize("content", ["a: [\n", "- 1\n", "\udcff"], ids=["not-yaml", "a-list", "not-utf8"])
def test_compare_names_a_damaged_recorded_config(two_runs, capsys, content):
    a, b = two_runs
    (b / "config.yaml").write_bytes(content.encode("utf-8", "surrogateescape"))
    assert main(["compare", str(b)]) == 2                 # alone: its paper section cannot be read
    err = capsys.readouterr().err
    assert f"{b / 'config.yaml'} is damaged" in err and "Traceback" not in err
    assert main(["compare", str(a), str(b)]) == 2         # pooled: whether it is the same experiment
    assert "has no readable config.yaml" in capsys.readouterr().err
    (b / "config.yaml").write_text("paper: 5\n")
    assert main(["compare", str(b)]) == 2
    assert "its paper section (5) is not a paper result" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "params", "message"), [
    ("fedprox", {"mu": True}, "algorithm.params.mu: expects a number, got true"),
    ("fedcme", {"exchange": False}, "algorithm.params.exchange: expects one of .*got false"),
    ("moon", {"tau": True}, "algorithm.params.tau: expects a number, got true"),
])
def test_a_boolean_is_not_a_method_parameters_number(small_config, name, params, message):
    with pytest.raises(ConfigError, match=message):
        make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": name, "params": params})))
    # a parameter that is a switch still takes one
    assert make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedacd",
                                                                          "params": {"mixup": False}}))).params.mixup is False


def test_fedcme_with_one_client_a_round_has_no_partner_and_is_refused(small_config):
    raw = cfg_of(small_config, algorithm={"name": "fedcme"})
    raw["train"].update(clients_per_round=1, local_epochs=2)
    with pytest.raises(ConfigError, match="clients_per_round is 1, so no client has a partner"):
        make_algorithm(load_config(raw=raw))
    raw["algorithm"]["params"] = {"exchange": "none"}           # FedCME-OL needs none
    assert make_algorithm(load_config(raw=raw)).params.exchange == "none"


def test_a_data_root_that_does_not_exist_is_named(small_config, tmp_path, monkeypatch):
    import fedhet.data.federated as federated

    raw = cfg_of(small_config)
    raw["data"]["root"] = str(tmp_path / "no_such_folder")
    with pytest.raises(DataError, match="data.root .*no_such_folder is not a folder"):
        build_federation(load_config(raw=raw).data, seed=0)
    # with data.download the missing folder is where the download goes: handed to the loader, not refused
    asked = []

    def loader(dataset, root, download, verify):
        asked.append((str(root), download))
        raise DataError("stop here")

    monkeypatch.setattr(federated, "load_splits", loader)
    raw["data"]["download"] = True
    with pytest.raises(DataError, match="stop here"):
        build_federation(load_config(raw=raw).data, seed=0)
    assert asked == [(str(tmp_path / "no_such_folder"), True)]


@pytest.mark.parametrize(("section", "key", "value"), [("train", "weight_decay", float("inf")),
                                                       ("train", "lr", float("nan"))])
def test_a_non_finite_setting_is_named_not_blamed_on_the_learning_rate_later(small_config, section, key, value):
    with pytest.raises(ConfigError, match=f"{key}: expects a finite number, got {value}"):
        load_config(raw=cfg_of(small_config, **{section: {key: value}}))
    with pytest.raises(ConfigError, match="algorithm.params.mu: expects a finite number, got inf"):
        make_algorithm(load_config(raw=cfg_of(small_config, algorithm={"name": "fedprox",
                                                                       "params": {"mu": float("inf")}})))


def test_a_numerical_stop_under_the_parallel_engine_is_one_message(small_config, tmp_path):
    """The workers inherit the command line's SIGTERM handler; terminated after another worker's
    error, they used to print a KeyboardInterrupt traceback each before the one-line error."""
    raw = cfg_of(small_config, run={**small_config["run"], "engine": "parallel", "workers": 2})
    raw["train"].update(lr=1e30, rounds=1, clients_per_round=3)
    path = tmp_path / "diverges.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "fedhet.cli", "run", str(path), "--out", str(tmp_path / "r"),
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "non-finite" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_split_that_a_small_pool_fraction_made_impossible_names_pool_fraction(small_config):
    raw = cfg_of(small_config)
    raw["data"]["pool_fraction"] = 0.05
    with pytest.raises(PartitionError, match="data.pool_fraction 0.05 keeps \\d+ images for 6 clients .*raise it"):
        build_federation(load_config(raw=raw).data, seed=0)
    raw["data"]["partition"] = {"kind": "grouped_dominant", "samples_per_client": 50, "s": 0.2}
    raw["data"]["num_clients"] = 4
    with pytest.raises(PartitionError) as caught:             # too few clients for the groups at any pool size
        build_federation(load_config(raw=raw).data, seed=0)
    assert "label groups but only 4 clients" in str(caught.value) and "pool_fraction" not in str(caught.value)
    raw["data"]["num_clients"] = 6
    raw["data"]["pool_fraction"] = 1.0
    raw["data"]["partition"] = {"kind": "dirichlet", "alpha": 0.5, "min_size": 10**6}
    with pytest.raises(PartitionError) as caught:             # the pool is whole: nothing to say about it
        build_federation(load_config(raw=raw).data, seed=0)
    assert "pool_fraction" not in str(caught.value)


# --- integrity of a run folder ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../escape", "/abs/x", "a/b", ".hidden", " "])
def test_a_run_name_that_is_a_path_is_refused(small_config, name):
    with pytest.raises(ConfigError, match="is not a plain name: a run's name names its folder"):
        load_config(raw=cfg_of(small_config, name=name))


@pytest.fixture(scope="module")
def stopped_run_once(synth_root, tmp_path_factory):
    """A 3-round run with a checkpoint every round, marked interrupted as a killed run is: trained
    once for this module's tests, which damage copies."""
    base = tmp_path_factory.mktemp("stopped_run")
    raw = small_config_in(synth_root, base / "runs")
    raw["train"].update(rounds=3)
    raw["run"].update(checkpoint_every=1)
    out = base / "r"
    Experiment.create(load_config(raw=raw), out).run(progress=False)
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    return out


@pytest.fixture
def stopped_run(stopped_run_once, tmp_path):
    return shutil.copytree(stopped_run_once, tmp_path / "r")


def test_a_damaged_checkpoint_is_refused_not_resumed(stopped_run):
    run = stopped_run
    content = bytearray((run / "checkpoint.pt").read_bytes())
    content[len(content) // 2] ^= 0xFF
    (run / "checkpoint.pt").write_bytes(bytes(content))
    with pytest.raises(CheckpointError, match="is damaged: its content no longer matches the sha256"):
        Experiment.resume(run)


def test_a_checkpoint_gone_missing_is_refused_and_the_metrics_kept(stopped_run, capsys):
    run = stopped_run
    metrics = (run / "metrics.jsonl").read_bytes()
    (run / "checkpoint.pt").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint.pt is missing, although .*checkpoint.sha256 records that "
                                              r"one was written.*delete .*checkpoint.sha256 to restart"):
        Experiment.resume(run)
    assert (run / "metrics.jsonl").read_bytes() == metrics
    (run / "checkpoint.sha256").unlink()                      # the fix the message names: from round 1
    exp = Experiment.resume(run)
    assert exp.start_round == 0
    exp.rundir.unlock()
    assert main(["run", "--resume", str(run)]) == 0
    assert "has no checkpoint: the run starts again from round 1" in capsys.readouterr().err
    assert [json.loads(r)["round"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_checkpoint_replaced_while_killed_between_the_digest_and_the_file_still_resumes(stopped_run):
    """The digest file names the new and the old digest while the checkpoint is replaced: a kill in
    between leaves the old checkpoint, which must still load."""
    run = stopped_run
    old = (run / "checkpoint.sha256").read_text().split()
    (run / "checkpoint.sha256").write_text("0" * 64 + "\n" + old[0] + "\n")
    assert Experiment.resume(run).start_round == 3


def test_a_run_whose_metrics_went_missing_is_refused(stopped_run):
    run = stopped_run
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(rows[0] + "\n" + rows[2] + "\n")
    with pytest.raises(CheckpointError, match="lacks round\\(s\\) 2, which the checkpoint of round 3 has done"):
        Experiment.resume(run)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(CheckpointError, match="lacks round\\(s\\) 1-3"):
        Experiment.resume(run)


def test_a_run_whose_metrics_file_is_damaged_is_refused_and_kept(stopped_run):
    run = stopped_run
    rows = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    for damage in (b"\xff\xfe\n", b"[1, 2]\n"):
        damaged = rows[0] + damage + b"".join(rows[1:])
        (run / "metrics.jsonl").write_bytes(damaged)
        with pytest.raises(CheckpointError, match="lacks round\\(s\\) 2-3 \\(its line 2 is damaged or out of place\\)"):
            Experiment.resume(run)
        assert (run / "metrics.jsonl").read_bytes() == damaged          # nothing dropped by the refusal
        with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: line 2 is damaged \(not the next round's record\), "
                                                r"so its 2 later line\(s\) are not read; .*rounds up to 1"):
            assert [r["round"] for r in read_metrics(run)] == [1]
    (run / "metrics.jsonl").write_bytes(b"".join(rows) + b"\xff{\"round\": 4")   # damage after the rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a last line cut off by a kill is no news: no warning
        assert [r["round"] for r in read_metrics(run)] == [1, 2, 3]
    resumed = Experiment.resume(run)
    assert resumed.start_round == 3
    resumed.rundir.unlock()
    # a stray row after the rounds (a round already recorded) is read as the end of the file: the
    # resumed run goes on after round 3 and writes its summary
    (run / "metrics.jsonl").write_bytes(b"".join(rows) + b'{"round": 2, "x": 1}\n')
    resumed = Experiment.resume(run, run_settings=["train.rounds=4"])
    assert resumed.start_round == 3 and resumed.run(progress=False)["rounds_completed"] == 4
    assert [r["round"] for r in read_metrics(run)] == [1, 2, 3, 4]


def test_a_damaged_digest_file_is_not_blamed_on_the_checkpoint(stopped_run):
    run = stopped_run
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    (run / "checkpoint.sha256").write_text("junk\n")
    with pytest.raises(CheckpointError, match=r"checkpoint.sha256 is damaged: it holds no sha256 digest.*the "
                                              r"checkpoint itself may be intact"):
        Experiment.resume(run)
    assert (run / "checkpoint.pt").read_bytes() == before["checkpoint.pt"]
    assert (run / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    (run / "checkpoint.sha256").unlink()                      # the fix the message names
    with pytest.warns(UserWarning, match=r"checkpoint .*checkpoint.pt has no recorded sha256 \(.*checkpoint.sha256 "
                                         r"is missing\): it is read unchecked"):
        assert Experiment.resume(run).start_round == 3


@pytest.mark.parametrize("command", [["run", "CFG", "--out"], ["run", "--resume"], ["flower", "run", "CFG", "--out"],
                                     ["flower", "run", "--resume"]], ids=["run-out", "run-resume", "flower-out",
                                                                          "flower-resume"])
def test_a_run_directory_that_is_empty_a_file_or_missing_is_named(small_config, tmp_path, monkeypatch, capsys,
                                                                  command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(small_config))
    args = [("c.yaml" if a == "CFG" else a) for a in command]
    option = command[-1]
    assert main([*args, ""]) == 2                   # an empty --out was the current folder
    assert f"{option} is empty" in capsys.readouterr().err
    assert main([*args, "c.yaml"]) == 2
    assert f"{option} c.yaml is a file, not a run directory" in capsys.readouterr().err
    if option == "--resume":
        assert main([*args, "nothere"]) == 2
        assert "--resume nothere does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]        # nothing started, nothing written


def test_python_out_that_is_empty_is_refused(small_config):
    import fedhet

    with pytest.raises(ConfigError, match="--out is empty"):
        fedhet.run(small_config, out="", progress=False)


# --- files that are not UTF-8 YAML ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_file_that_is_not_utf8_text_is_named_with_its_line(tmp_path, capsys, command):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: x\n# caf\u00e9 au lait\nseed: 0\n".encode("latin-1"))
    assert main([command, str(latin)]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text: byte 0xe9 on line 2" in err and "save the file as UTF-8" in err
    (tmp_path / "folder.yaml").mkdir()
    assert main([command, str(tmp_path / "folder.yaml")]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\x00\x01")
    assert main([command, str(binary)]) == 2
    assert "holds NUL bytes: it is a binary file" in capsys.readouterr().err


def test_an_accented_comment_in_utf8_is_fine(small_config, tmp_path):
    path = tmp_path / "utf8.yaml"
    path.write_text("# caf\u00e9 au lait\n" + yaml.safe_dump(small_config), encoding="utf-8")
    assert load_config(path).name == "tiny"


# --- a newcomer's path ---------------------------------------------------------------------------
def test_compare_pools_a_parameter_given_at_its_default_with_one_left_out(two_runs, capsys):
    """config.yaml keeps algorithm.params as given; the summaries' algorithm_params (every default
    filled in) decide whether two runs ran the same method settings."""
    a, b = two_runs
    assert json.loads((a / "summary.json").read_text())["algorithm_params"] == {
        "bn_buffers": "average", "mixup": False, "mixup_alpha": 1.0, "augment": "none"}

    def recorded_as(run, given, resolved):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["algorithm"]["params"] = given
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        summary = json.loads((run / "summary.json").read_text())
        summary["algorithm_params"] = resolved
        (run / "summary.json").write_text(json.dumps(summary))

    defaults = json.loads((a / "summary.json").read_text())["algorithm_params"]
    recorded_as(b, {"mixup_alpha": 1.0}, defaults)            # the default, given
    assert main(["compare", str(a), str(b)]) == 0
    assert "| tiny | fedavg | global_acc | 2 |" in capsys.readouterr().out
    recorded_as(b, {"mixup_alpha": 0.4}, {**defaults, "mixup_alpha": 0.4})
    assert main(["compare", str(a), str(b)]) == 2
    assert "algorithm.params" in capsys.readouterr().err
    # a parameter the method gained after one run: that run's config decides (absent: the default)
    recorded_as(b, {}, {**defaults, "gained": 3})
    assert main(["compare", str(a), str(b)]) == 0
    capsys.readouterr()
    recorded_as(b, {"gained": 3}, {**defaults, "gained": 3})
    assert main(["compare", str(a), str(b)]) == 2
    assert "algorithm.params" in capsys.readouterr().err
    # a run from before summaries held the parameters: the configs as given decide
    summary = json.loads((a / "summary.json").read_text())
    del summary["algorithm_params"]
    (a / "summary.json").write_text(json.dumps(summary))
    recorded_as(b, {"mixup_alpha": 1.0}, defaults)
    assert main(["compare", str(a), str(b)]) == 2
    assert "algorithm.params: {} in" in capsys.readouterr().err


def test_list_a_method_gives_its_parameters_types_bounds_and_defaults(capsys):
    assert main(["list", "fedrema"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["delta"].split() == ["delta", "a", "number,", ">", "0,", "<", "1", "default", "0.5", "(FedReMa)"]
    assert rows["ccp"].split()[1:5] == ["one", "of", "'adaptive',", "'forever'"] and "default 'adaptive'" in rows["ccp"]
    assert rows["alternating"].split()[1:4] == ["true", "or", "false"]
    assert rows["mixup"].split()[-1] == "(FedAvg)"          # inherited, listed after FedReMa's own
    assert list(rows).index("mixup") > list(rows).index("align_weight")
    assert main(["list", "fedprox+fedfm"]) == 0
    out = capsys.readouterr().out
    assert "the composition of fedprox, fedfm" in out and "(FedProx)" in out and "(FedFM)" in out
    assert main(["list", "fedx"]) == 2
    assert "unknown algorithm 'fedx'" in capsys.readouterr().err


def test_list_a_users_method_describes_it_by_its_class_where_it_has_a_docstring(capsys, tmp_path, monkeypatch):
    """One module of a user's may hold several methods: each is described by its own docstring."""
    module_of_ones_own(tmp_path, monkeypatch, "lab_two",
                       '"""The methods of my lab."""\nfrom fedhet.algorithms.fedavg import FedAvg\n\n\n'
                       'class Damped(FedAvg):\n    """FedAvg with a damped server step. More."""\n    name = "damped"\n'
                       '\n\nclass Plain(FedAvg):\n    name = "plain"\n')
    assert main(["list", "lab_two:Damped"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("FedAvg with a damped server step")
    assert main(["list", "lab_two:Plain"]) == 0                      # no docstring of its own: the module's
    assert capsys.readouterr().out.splitlines()[0].endswith("The methods of my lab")


def test_partition_heatmap_goes_to_the_output_folder(small_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(small_config))
    assert main(["partition", "c.yaml"]) == 0
    assert not list(tmp_path.glob("*.png"))
    assert (tmp_path / "runs" / "tiny-partition.png").exists()
    fed = build_federation(load_config(raw=small_config).data, small_config["seed"])
    summary = capsys.readouterr().out.splitlines()[-2]
    assert summary.endswith(f"local test: test_set; global test set: {len(fed.test.y)} images of "
                            f"{len(fed.test.y.unique())} classes")


def test_list_describes_every_algorithm(capsys):
    from fedhet.algorithms import ALGORITHMS

    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ALGORITHMS:
        line = next(x for x in lines if x.split()[:1] == [name])
        assert len(line.split(maxsplit=1)[1]) > 10, line
    # and the forms a user's own dataset, partition and model take
    own = {x.split(":", 1)[0]: x.rsplit("your own: ", 1)[1] for x in lines if "your own: " in x and ":" in x}
    assert own["datasets"] == "npz:PATH, folder:PATH, MODULE:FUNCTION"
    assert own["partitions"] == "MODULE:FUNCTION" and own["models"] == "MODULE:BUILDER"


# --- data.normalize ------------------------------------------------------------------------------
def test_normalize_replaces_the_dataset_statistics(small_config):
    from fedhet.core.errors import DataError

    default = load_config(raw=small_config)
    own = load_config(raw=cfg_of(small_config, data={"normalize": {"mean": [0.5], "std": [0.5]}}))
    fed_default, fed_own = build_federation(default.data, 0), build_federation(own.data, 0)
    x = fed_own.pool.x[:4]
    assert torch.allclose(fed_own.normalize(x), (x.float() / 255 - 0.5) / 0.5)
    assert not torch.allclose(fed_default.normalize(x), fed_own.normalize(x))     # Fashion-MNIST's 0.2860 / 0.3530
    three = load_config(raw=cfg_of(small_config, data={"normalize": {"mean": [0.5] * 3, "std": [0.5] * 3}}))
    with pytest.raises(DataError, match="data.normalize gives 3 mean and 3 std values for 1 channel"):
        build_federation(three.data, 0)
    with pytest.raises(ConfigError, match="data.normalize.std.0"):
        load_config(raw=cfg_of(small_config, data={"normalize": {"mean": [0.5], "std": [0.0]}}))


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `fedhet list | head -1`: the reader closes the pipe before fedhet writes; no traceback, exit 141 as a shell's.
    proc = subprocess.Popen([sys.executable, "-m", "fedhet.cli", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr


# --- eval.local_risk on models uploaded in part -------------------------------------------------
def test_local_risk_is_refused_for_a_method_that_uploads_only_the_body(small_config):
    """FedPer uploads its body as "model": its risk would be that of the body with the initial head."""
    cfg = load_config(raw=cfg_of(small_config, algorithm={"name": "fedper"}, eval={"every": 1, "local_risk": True}))
    with pytest.raises(ConfigError, match=r"eval.local_risk: fedper's clients upload only part of their \w+ model "
                                          r"\(head\..* stay on the client\).*set eval.local_risk: false for this method"):
        build(cfg)
    cfg.eval.local_risk = False
    build(cfg)


class BodyOnlyUpload(FedAvg):
    """A client_update of one's own that uploads the body only, past uploaded_model."""
    name = "body_only_upload"

    def client_update(self, msg, state, client):
        reply, state = super().client_update(msg, state, client)
        reply.arrays["model"] = select(reply.arrays["model"], BODY)
        return reply, state


def test_local_risk_stops_at_a_model_uploaded_in_part_past_uploaded_model(small_config, tmp_path, monkeypatch):
    """Checked every round, not only at evaluated ones: the run stops in round 1, not at round 3."""
    monkeypatch.setitem(ALGORITHMS, BodyOnlyUpload.name, BodyOnlyUpload)
    raw = cfg_of(small_config, algorithm={"name": BodyOnlyUpload.name}, eval={"every": 3, "local_risk": True},
                 train={"rounds": 3})
    exp = Experiment.create(load_config(raw=raw), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"eval.local_risk: body_only_upload's client \d+ uploaded only part of its "
                                          r"model \(head\..* missing\)"):
        exp.run(progress=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0


def test_local_risk_of_fedbabu_judges_the_shared_part_with_its_frozen_initial_head(small_config, tmp_path):
    raw = cfg_of(small_config, algorithm={"name": "fedbabu"}, eval={"every": 1, "local_risk": True},
                 train={"rounds": 1})
    exp = Experiment.create(load_config(raw=raw), tmp_path / "run")
    exp.run(progress=False)
    init = exp.loop.host.init_models["cnn2"]
    assert exp.local_models and all(set(m) == set(init) for m in exp.local_models.values())
    assert all(torch.equal(m[k], init[k]) for m in exp.local_models.values() for k in init if k.startswith("head."))
    assert exp.summary["status"] == "completed" and 0 <= exp.read_metrics()[-1]["local_risk"] <= 1


def test_the_command_line_prints_fedhets_warnings_as_one_line(small_config, tmp_path):
    """fedhet's own warnings read `fedhet: warning: ...`, not Python's file:line and source line (a
    process of its own: pytest records warnings instead of printing them)."""
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg_of(small_config, algorithm={"name": "perfedavg"},
                                          train={**small_config["train"], "rounds": 1, "momentum": 0.5})))
    done = subprocess.run([sys.executable, "-m", "fedhet.cli", "run", str(path), "--out", str(tmp_path / "r"),
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fedhet: warning: perfedavg does not apply train.momentum" in done.stderr
    assert "UserWarning" not in done.stderr and "runner.py" not in done.stderr

    import fedhet.experiment.runner
    from fedhet.cli import _format_warning
    assert "UserWarning" in _format_warning("theirs", UserWarning, "/elsewhere/lib.py", 3)   # another package's
    assert _format_warning("ours", UserWarning, fedhet.experiment.runner.__file__, 3) == "fedhet: warning: ours\n"


def test_a_resume_writes_a_lost_partition_json_again(stopped_run):
    """A run's partition.json pairs it with the baseline of its seed; a partial copy that lost it gets it back."""
    before = (stopped_run / "partition.json").read_text()
    (stopped_run / "partition.json").unlink()
    Experiment.resume(stopped_run).rundir.unlock()
    assert (stopped_run / "partition.json").read_text() == before


def test_compare_names_a_summary_whose_final_is_not_a_finite_number(two_runs, capsys):
    a, b = two_runs
    summary = json.loads((b / "summary.json").read_text())
    summary["metrics"]["global_acc"]["final"] = float("nan")
    (b / "summary.json").write_text(json.dumps(summary))
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{b / 'summary.json'} is damaged" in err and "global_acc" in err and "Traceback" not in err


def test_a_compare_plot_of_groups_with_different_headlines_names_each_lines_metric(two_runs, tmp_path, monkeypatch):
    import fedhet.experiment.report.table as table

    a, b = two_runs
    summary = json.loads((b / "summary.json").read_text())
    (b / "summary.json").write_text(json.dumps({**summary, "name": "other", "headline_metric": "personal_acc"}))
    drawn = []
    monkeypatch.setattr(table, "plot_compare", lambda curves, label, path: drawn.append((sorted(curves), label)))
    table.compare([a, b], None, tmp_path / "c.png")
    assert drawn == [(["other: personal_acc", "tiny: global_acc"], "headline metric")]
    table.compare([a], None, tmp_path / "c.png")                     # one headline: named on the axis
    assert drawn[1] == (["tiny"], "global_acc")


def test_a_misspelt_model_or_dataset_name_gets_the_nearest_name():
    from fedhet.data.datasets import load_dataset
    from fedhet.models import build_model

    with pytest.raises(ValueError, match=r"^unknown model 'cnn3' \(did you mean cnn2\?\); valid models: cnn2, "):
        build_model("cnn3", 1, 10, 28)
    with pytest.raises(ValueError, match=r"^unknown model 'zzz'; valid models"):
        build_model("zzz", 1, 10, 28)
    for typed in ("fashionmnist", "Fashion-MNIST"):
        with pytest.raises(DataError, match=rf"^unknown dataset '{typed}' \(did you mean fashion_mnist\?\)"):
            load_dataset(typed)


def test_command_line_options_that_would_be_ignored_or_given_twice_are_refused(tmp_path, capsys):
    from fedhet.cli import main

    assert main(["run", "--resume", str(tmp_path / "r"), "--out", str(tmp_path / "elsewhere")]) == 2
    assert f"--resume continues the run in its own folder ({tmp_path / 'r'}); --out does not apply" in \
        capsys.readouterr().err
    assert main(["run", "configs/quickstart.yaml", "--threads", "1", "--set", "run.threads=2"]) == 2
    assert "run.threads is given twice, as --threads 1 and as --set run.threads=2: give it once" in \
        capsys.readouterr().err
    assert main(["resume", str(tmp_path / "r")]) == 2
    assert "there is no resume command: fedhet run --resume RUN_DIR continues a run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("fedhet ")


@pytest.mark.parametrize(("name", "said"), [
    ("dirichlet", ["dirichlet: Dirichlet label skew, NIID-Bench", "  alpha  float  required",
                   "  min_size  int  default 10", "  min_classes  int  default 0"]),
    ("natural", ["  test_writers  default 0  (the fraction of the pool's writers whose images are the global test set"]),
    ("resnet18", ["head from stage fc on by default (model.split to move it); model.norm: bn (default) or gn",
                  "  stem  default 'cifar'", "  gn_groups  default 2", "  fc_bias  default True"]),
    ("cnn2", ["cnn2: McMahan et al. 2017 FedAvg", "no normalisation layer (model.norm does not apply)",
              "no options (model.options stays empty)"]),
    ("femnist", ["femnist: 62 classes, 1x28x28 images", "to get it: generate it with LEAF"])])
def test_fedhet_list_describes_a_partition_model_or_dataset_by_its_name(name, said, capsys):
    from fedhet.cli import main

    assert main(["list", name]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line in said:
        assert any(line in out for out in lines), (line, lines)


@pytest.mark.parametrize(("word", "listed"), [("datasets", "datasets"), ("model", "models"), ("methods", "algorithms"),
                                             ("partition", "partitions")])
def test_fedhet_list_of_a_category_says_to_list_without_a_name(word, listed, capsys):
    from fedhet.cli import main

    assert main(["list", word]) == 2
    assert (f"fedhet list NAME describes the method, model, dataset or partition kind of that name, and {word} is "
            f"none: fedhet list, without a NAME, lists the {listed}") in capsys.readouterr().err


def test_a_kind_changed_alone_names_the_parameters_left_from_the_other_kind(small_config):
    """--set data.partition.kind=... keeps the section's other keys: the error says to give the whole section."""
    raw = cfg_of(small_config)
    cfg = load_config(raw=raw, overrides=["data.partition.kind=iid"])
    with pytest.raises(PartitionError, match=r"partition 'iid': unknown parameter\(s\) alpha, min_size; .*give the "
                                             r"whole section, e.g. --set 'data.partition=\{kind: iid, \.\.\.\}'"):
        build_federation(cfg.data, cfg.seed)


def test_sigterm_to_every_process_of_a_parallel_run_lets_its_round_end(small_config, tmp_path):
    """A service manager's stop sends SIGTERM to the run and its workers at once: the workers
    ignore it and finish the round, which the run records and checkpoints before it stops."""
    import json
    import os
    import signal
    import time

    import torch

    from fedhet.experiment.runner import read_metrics

    raw = cfg_of(small_config, run={**small_config["run"], "engine": "parallel", "workers": 2, "checkpoint_every": 1000})
    raw["train"].update(rounds=200)
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "fedhet.cli", "run", str(path), "--out", str(run_dir),
                             "--no-progress", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        end = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or not read_metrics(run_dir):
            assert time.monotonic() < end and proc.poll() is None, "the run never finished a round"
            time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    done = summary["rounds_completed"]
    assert (summary["status"], summary["error"]) == ("interrupted", f"stopped after round {done}: SIGTERM received")
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["round"] == done


def test_settings_that_would_do_nothing_alone_are_refused(small_config):
    """Each of these means something only beside another setting: given alone it would be ignored."""
    from fedhet.experiment.build import algorithm_and_federation

    for overrides, said in [
        (["train.betas=[0.5, 0.9]"], "train.betas are Adam's; with optimizer: sgd they would do nothing"),
        (["run.client_state_store=disk", "run.client_state_memory_mb=5"],
         "run.client_state_memory_mb is the budget of client_state_store: auto; the store 'disk' keeps every "
         "state on disk"),
        (["run.mlflow_tracking_uri=http://x"], "run.mlflow_tracking_uri is where the mlflow logger writes, and "
                                               "run.loggers does not list mlflow"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_config(raw=cfg_of(small_config), overrides=overrides)
    load_config(raw=cfg_of(small_config), overrides=["train.optimizer=adam", "train.betas=[0.5, 0.9]"])
    cfg = load_config(raw=cfg_of(small_config), overrides=["algorithm.name=local", "eval.features_every=1"])
    with pytest.raises(ConfigError, match="eval.features_every: the feature-space metrics are of the global model, "
                                          "and local has none"):
        algorithm_and_federation(cfg)


def test_more_threads_than_usable_cpus_is_said(small_config, monkeypatch):
    import fedhet.experiment.build as build_module

    monkeypatch.setattr(build_module, "usable_cpus", lambda: 2)
    before = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match="run.threads 3 is more than the 2 CPU\\(s\\) this process may use"):
            build_module.configure_process(load_config(raw=cfg_of(small_config), overrides=["run.threads=3"]))
    finally:
        torch.set_num_threads(before)


def test_a_colon_without_its_space_says_what_yaml_read_and_the_fix(small_config, tmp_path):
    """{kind:iid} is YAML's one key 'kind:iid' with no value: the partition error named dirichlet (the
    key the section kept) and the model one an unexpected keyword 'hidden:64'."""
    from fedhet.experiment.config import apply_override

    with pytest.raises(ConfigError, match=r"--set data.partition=\{kind:iid\}: 'kind:iid' reads as one key with no "
                                          r"value: YAML needs a space after the colon, write \{kind: iid\}"):
        apply_override(copy.deepcopy(small_config), "data.partition={kind:iid}")
    with pytest.raises(ConfigError, match=r"'hidden:64' reads as one key .* write \{hidden: 64\}"):
        apply_override(copy.deepcopy(small_config), "model.options={hidden: 1, extra: [{hidden:64}]}")
    path = tmp_path / "glued.yaml"
    path.write_text("train: {rounds:1}\n")
    with pytest.raises(ConfigError, match=f"{path}: 'rounds:1' reads as one key with no value"):
        load_config(path)
    # a key of one's own that holds a colon and a value is left alone
    raw = copy.deepcopy(small_config)
    apply_override(raw, "model.arch_options={nets:small_mlp: {hidden: 8}}")
    assert raw["model"]["arch_options"] == {"nets:small_mlp": {"hidden": 8}}


def test_a_methods_parameter_beside_its_name_points_to_algorithm_params(small_config):
    with pytest.raises(ConfigError, match=r"algorithm.mu: unknown key \(a method's own parameters go under "
                                          r"algorithm.params: algorithm.params.mu\)"):
        load_config(raw=cfg_of(small_config, algorithm={"name": "fedprox", "mu": 0.1}))
    with pytest.raises(ConfigError, match=r"algorithm.nmae: unknown key \(did you mean name\?\)"):
        load_config(raw=cfg_of(small_config, algorithm={"nmae": "fedprox"}))


def test_fedhet_list_describes_a_function_or_data_of_ones_own_and_refuses_a_half_combination(
        capsys, tmp_path, monkeypatch):
    from fedhet.cli import main

    (tmp_path / "own_list.py").write_text(
        "def widths(in_channels, num_classes, image_size, hidden: int = 16, *args, **options):\n"
        "    '''A ``small`` builder of mine.'''\n\nclass NotAMethod:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["list", "own_list:widths"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "own_list:widths: A small builder of mine."          # no reStructuredText markup
    assert lines[2:] == ["  in_channels  required", "  num_classes  required", "  image_size  required",
                         "  hidden  int  default 16"]
    assert main(["list", "npz:data/mine.npz"]) == 0
    assert capsys.readouterr().out.startswith("npz:data/mine.npz: data of your own (arrays in an .npz file)")
    assert main(["list", "own_list:NotAMethod"]) == 2
    assert "own_list:NotAMethod" in capsys.readouterr().err
    assert main(["list", "builtins:getattr"]) == 0                          # no signature to read: said
    assert capsys.readouterr().out.splitlines()[-1] == "  (its signature cannot be read)"
    assert main(["list", "fedprox+"]) == 2
    assert ("algorithm 'fedprox+': a combination names a method on each side of every '+', e.g. fedprox+fedfm"
            in capsys.readouterr().err)


def test_a_missing_config_given_by_a_relative_path_names_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "configs/quickstart.yaml"]) == 2
    assert (f"config file configs/quickstart.yaml does not exist (a relative path, read from the working directory "
            f"{tmp_path})") in capsys.readouterr().err
    assert main(["run", str(tmp_path / "nothere.yaml")]) == 2
    assert capsys.readouterr().err.rstrip().endswith(f"config file {tmp_path / 'nothere.yaml'} does not exist")


def test_one_item_where_a_list_goes_says_to_write_the_brackets(small_config):
    with pytest.raises(ConfigError, match=r"run.loggers: .*a list is written in brackets, even of one item: --set "
                                          r"'run.loggers=\[tensorboard\]' or loggers: \[tensorboard\] in the file"):
        load_config(raw=small_config, overrides=["run.loggers=tensorboard"])


def test_a_set_into_a_value_the_config_gives_blames_the_config(small_config):
    with pytest.raises(ConfigError, match=r"--set train.rounds: 'train' holds 5 where the config \(or an earlier "
                                          r"--set\) gives it, not a section of settings \(a mapping\): write train as "
                                          r"one, e.g. `train: \{rounds: ...\}`"):
        load_config(raw={**small_config, "train": 5}, overrides=["train.rounds=1"])


@pytest.mark.parametrize("words", [["train.rounds", "=", "1"], ["train.rounds=", "1"], ["train.rounds", "=1"]])
def test_a_set_split_by_spaces_says_it_is_one_word(words, capsys):
    assert main(["run", "configs/quickstart.yaml", "--set", *words]) == 2
    assert "a --set is one word, KEY=VALUE, with no space around the '='" in capsys.readouterr().err


def test_a_set_ending_in_its_equals_sign_alone_is_left_to_the_config(small_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(small_config))
    assert main(["partition", "c.yaml", "--set", "data.num_clients="]) == 2        # null: the config says so
    assert "one word" not in capsys.readouterr().err


def test_a_method_changed_under_a_name_that_names_the_old_one_is_said(small_config):
    raw = cfg_of(small_config, name="quickstart-fedrema", algorithm={"name": "fedrema"})
    with pytest.warns(UserWarning, match=r"the run is named 'quickstart-fedrema', after the method 'fedrema' its config "
                                         r"names, and runs 'local': .*--set name=\.\.\. to tell them apart"):
        load_config(raw=copy.deepcopy(raw), overrides=["algorithm.name=local"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(raw=copy.deepcopy(raw), overrides=["algorithm.name=local", "name=quickstart-local"])
        load_config(raw=copy.deepcopy(raw), overrides=["train.rounds=1"])
