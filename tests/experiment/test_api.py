"""fedhet.run: the Python API returns what the run directory records."""

import pytest
import yaml

import fedhet
from fedhet.core.errors import CheckpointError, ConfigError
from fedhet.experiment.rundir import read_metrics


def test_run_from_a_dict_with_overrides_returns_the_recorded_metrics(small_config, tmp_path):
    res = fedhet.run(small_config, {"train.rounds": 2, "train.lr": 0.1}, out=tmp_path / "r")
    assert res.run_dir == tmp_path / "r"
    assert [r["round"] for r in res.rows] == [1, 2]                  # the override took effect
    assert res.rows == read_metrics(tmp_path / "r")
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["train"]["lr"] == 0.1
    assert res.summary["status"] == "completed" and res.summary["rounds_completed"] == 2
    accs = res.metric("global_acc")
    assert [r for r, _ in accs] == [1, 2] and accs[-1][1] == res.rows[-1]["global_acc"]
    # chance on the 10 synthetic classes is 0.1; two rounds of FedAvg learn the blocks far beyond it
    assert res.summary["headline"]["best"] > 0.5
    with pytest.raises(KeyError, match=r"recorded 'global_accc'; it recorded: .*global_acc, "):
        res.metric("global_accc")
    for not_numbers, holds in (("comm", "values of type dict"), ("round", "the round itself")):
        with pytest.raises(KeyError, match=f"'{not_numbers}' is not a metric of numbers by round \\(it holds {holds}"):
            res.metric(not_numbers)
    res.rows[0]["fedavg_flag"] = True                   # a method's flag by round (FedReMa's CCP) is one
    assert res.metric("fedavg_flag") == [(1, True)]
    del res.rows[0]["fedavg_flag"]
    from fedhet.experiment.report import compare
    assert compare(str(tmp_path / "r"), None, None).startswith("| run |")      # one run's path, as a string
    assert repr(res) == (f"Results({str(tmp_path / 'r')!r}, fedavg, completed, 2 rounds, global_acc, "
                         f"final {res.summary['headline']['final']:.4f})")
    # a finished run extended from Python, as `fedhet run --resume DIR --set train.rounds=3`
    more = fedhet.resume(tmp_path / "r", {"train.rounds": 3}, progress=False)
    assert [r for r, _ in more.metric("global_acc")] == [1, 2, 3] and more.rows[:2] == res.rows
    with pytest.raises(ConfigError, match="a resumed run takes --set only for how it is carried out"):
        fedhet.resume(tmp_path / "r", {"train.lr": 0.5})


def test_run_from_a_yaml_path_with_set_style_overrides(small_config, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(small_config))
    res = fedhet.run(path, ["train.rounds=1"], out=tmp_path / "p")
    assert len(res.rows) == 1


def test_run_refuses_what_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="config must be"):
        fedhet.run(42, out=tmp_path / "x")
    with pytest.raises(ConfigError, match="--out 123 is of type int: name the run directory as a path"):
        fedhet.run({}, out=123)
    with pytest.raises(ConfigError, match=r"invalid config \(the config given with the overrides "
                                          r"train.nonsense=1\):\n  train.nonsense"):
        fedhet.run({}, {"train.nonsense": 1}, out=tmp_path / "y")
    with pytest.raises(ConfigError, match=r"invalid config \(the config given\):\n  trian: unknown key \(did you "
                                          r"mean train\?\)"):                  # no overrides to blame
        fedhet.run({"trian": {}}, out=tmp_path / "z")


def test_numpy_values_are_plain_values(small_config, tmp_path):
    """Overrides and dict configs built with NumPy (a notebook's grid) are the numbers they hold."""
    import numpy as np

    raw = {**small_config, "train": {**small_config["train"], "lr": np.float64(0.1)}}
    res = fedhet.run(raw, {"train.rounds": np.int64(1), "eval.personalized": np.bool_(False),
                           "train.weight_decay": np.float32(0.5)}, out=tmp_path / "n")
    recorded = yaml.safe_load((tmp_path / "n" / "config.yaml").read_text())
    assert recorded["train"]["rounds"] == 1 and recorded["train"]["lr"] == 0.1
    assert recorded["eval"]["personalized"] is False and recorded["train"]["weight_decay"] == 0.5
    assert len(res.rows) == 1


def test_overrides_of_the_wrong_shape_say_what_to_give(small_config, tmp_path):
    with pytest.raises(ConfigError, match=r"overrides\['train.rounds'\]: a object .* cannot be written to a config"):
        fedhet.run(small_config, {"train.rounds": object()}, out=tmp_path / "a")
    with pytest.raises(ConfigError, match="not str \\(one string: wrap it in a list\\)"):
        fedhet.run(small_config, "train.rounds=1", out=tmp_path / "b")
    with pytest.raises(ConfigError, match="overrides must be a dict .* not int"):
        fedhet.run(small_config, 5, out=tmp_path / "c")
    with pytest.raises(ConfigError, match="key 1 is not a string"):
        fedhet.run(small_config, {1: 2}, out=tmp_path / "d")
    with pytest.raises(ConfigError, match="'train' holds 5 where the config \\(or an earlier --set\\) gives it, not a section"):
        fedhet.run({**small_config, "train": 5}, {"train.rounds": 1}, out=tmp_path / "e")
    assert not any((tmp_path / n).exists() for n in "abcde")


def test_a_plot_that_cannot_be_written_is_a_warning_and_the_run_stays_completed_and_free(small_config, tmp_path):
    (tmp_path / "r" / "accuracy.png").mkdir(parents=True)        # the plot's path taken by a folder
    with pytest.warns(RuntimeWarning, match=r"cannot write the plot .*accuracy.png.*; the run's summary.json and "
                                            r"metrics.jsonl are written"):
        res = fedhet.run(small_config, {"train.rounds": 1}, out=tmp_path / "r")
    assert res.summary["status"] == "completed" and [r["round"] for r in res.rows] == [1]
    with pytest.warns(RuntimeWarning, match="cannot write the plot"):   # the folder is free: it goes on
        assert fedhet.resume(tmp_path / "r", {"train.rounds": 2}).summary["rounds_completed"] == 2


def test_a_failed_run_raises_its_own_error_names_its_folder_and_leaves_it_free_to_load(small_config, tmp_path,
                                                                                      monkeypatch):
    from fedhet.core.errors import NumericalError
    from fedhet.experiment.rundir import RunDir
    from fedhet.experiment.runner import Experiment

    def summary_fails_too(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Experiment, "write_summary", summary_fails_too)
    with pytest.warns(RuntimeWarning, match="recording the summary of the failed run failed too: OSError"):
        with pytest.raises(NumericalError) as info:             # the run's error, not the summary's
            fedhet.run(small_config, {"train.lr": 1e6, "train.rounds": 2}, out=tmp_path / "r")
    assert info.value.__notes__[0] == (f"run directory: {tmp_path / 'r'} (fedhet.load reads what it recorded; it "
                                       "has no checkpoint yet (one every run.checkpoint_every = 2 rounds), so "
                                       "fedhet.resume would start it again from round 1)")
    RunDir(tmp_path / "r").lock()                                # not held by this process any more
    monkeypatch.undo()
    loaded = fedhet.load(tmp_path / "r")
    assert loaded.summary == {} and loaded.rows == read_metrics(tmp_path / "r")
    assert repr(loaded) == f"Results({str(tmp_path / 'r')!r}, no summary, {len(loaded.rows)} rounds recorded)"
    with pytest.raises(CheckpointError, match="fedhet.load .*nothing does not exist"):
        fedhet.load(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="fedhet.resume .*nothing does not exist"):    # not --resume
        fedhet.resume(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="fedhet.load None is of type NoneType"):
        fedhet.load(None)


def test_resuming_from_python_warns_where_the_command_line_says_so(small_config, tmp_path):
    from fedhet.experiment.config import load_config
    from fedhet.experiment.runner import Experiment

    Experiment.create(load_config(raw=small_config), tmp_path / "r").rundir.unlock()     # made, never run
    with pytest.warns(UserWarning, match="has no checkpoint: the run starts again from round 1"):
        fedhet.resume(tmp_path / "r", {"train.rounds": 1})
    raw = {**small_config, "eval": {**small_config["eval"], "every": 2}}
    fedhet.run(raw, {"train.rounds": 1}, out=tmp_path / "s")
    with pytest.warns(UserWarning, match="round 1 was evaluated as the last round"):
        fedhet.resume(tmp_path / "s", {"train.rounds": 2})


def test_a_run_stopped_after_a_checkpoint_names_the_round_a_resume_goes_on_from(small_config, tmp_path, monkeypatch):
    from fedhet.experiment.config import load_config
    from fedhet.experiment.runner import Experiment

    exp = Experiment.create(load_config(raw={**small_config, "train": {**small_config["train"], "rounds": 4}}),
                            tmp_path / "r")
    real = exp.loop.run_round

    def stopped(r, *args):
        if r == 3:                      # rounds 1-3 ran, the checkpoint of round 2 keeps the run
            raise KeyboardInterrupt
        return real(r, *args)

    monkeypatch.setattr(exp.loop, "run_round", stopped)
    with pytest.raises(KeyboardInterrupt) as info:
        exp.run(progress=False)
    assert info.value.__notes__[0].endswith("fedhet.resume goes on from its checkpoint of round 2)")
