"""Methods and models of the user's own, named by import path (MODULE:NAME): the example files in
examples/extending run on every engine like built-in ones, and every way of naming them wrongly is
a clear error that names the key, the value and the fix."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import build_loop

import fedhet
import fedhet.extend
from fedhet.core.errors import ConfigError
from fedhet.experiment.build import make_algorithm
from fedhet.experiment.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "extending"


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("feddamp", "nets", "flips", "broken_plugin"):
        sys.modules.pop(name, None)


def cfg_of(small_config, **sections):
    raw = copy.deepcopy(small_config)
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return load_config(raw=raw)


def one_round_state(cfg):
    loop = build_loop(cfg)
    start = {k: v.clone() for k, v in loop.server_state["model"].items()}
    loop.run_round(0)
    return start, loop.server_state["model"]


def test_a_method_named_by_import_path_runs_its_own_server_rule(small_config, examples_on_path):
    """FedDamp with no logit penalty trains as FedAvg does; its server moves server_lr of the way
    from the old model to FedAvg's average (hand rule: old + lr * (avg - old))."""
    plain = cfg_of(small_config, train={"rounds": 1})
    damp = cfg_of(small_config, train={"rounds": 1},
                  algorithm={"name": "feddamp:FedDamp", "params": {"server_lr": 0.25, "logit_penalty": 0.0}})
    start, averaged = one_round_state(plain)
    start_damp, damped = one_round_state(damp)
    for k, v in start.items():
        assert torch.equal(v, start_damp[k])
        if v.is_floating_point():
            torch.testing.assert_close(damped[k], v + 0.25 * (averaged[k] - v), rtol=1e-6, atol=1e-7)


def test_a_plugin_loss_term_reaches_training(small_config, examples_on_path):
    from feddamp import LogitPenalty

    from fedhet.extend import Forward
    logits = torch.tensor([[1.0, -2.0], [3.0, 0.0]])
    assert float(LogitPenalty(0.5)(Forward(torch.zeros(2, 1), logits), None, {})) == pytest.approx(0.5 * 14 / 4)
    _, without = one_round_state(cfg_of(small_config, algorithm={"name": "feddamp:FedDamp",
                                                                 "params": {"logit_penalty": 0.0}}))
    _, with_term = one_round_state(cfg_of(small_config, algorithm={"name": "feddamp:FedDamp",
                                                                   "params": {"logit_penalty": 1.0}}))
    assert any(not torch.equal(without[k], with_term[k]) for k in without)


def test_a_plugin_method_and_model_run_end_to_end_and_vmapped(small_config, examples_on_path, tmp_path):
    """fedhet.run with both plugins on every engine: the vectorized engine vmaps the plugin's term (no
    fallback) and the parallel engine's workers run it, both ending where the reference engine does;
    a plugin composes with a built-in method by '+'."""
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "fedprox+feddamp:FedDamp", "params": {"mu": 0.01}}
    raw["model"] = {"arch": "nets:small_mlp", "options": {"hidden": 32}}
    raw["train"]["rounds"] = 2
    ref = fedhet.run(raw, {"run.engine": "reference"}, out=tmp_path / "ref", progress=False)
    vec = fedhet.run(raw, {"run.engine": "vectorized"}, out=tmp_path / "vec", progress=False)
    assert ref.summary["status"] == vec.summary["status"] == "completed"
    assert ref.summary["algorithm"] == "fedprox+feddamp"
    engine = vec.summary["engine"]
    assert engine["fallback_requests"] == 0 and engine["vectorized_requests"] > 0, engine
    for (_, a), (_, b) in zip(ref.metric("train_loss"), vec.metric("train_loss")):
        assert a == pytest.approx(b, rel=1e-4)
    # forked workers import the plugins as the parent did, and end where the reference engine does
    par = fedhet.run(raw, {"run.engine": "parallel", "run.workers": 2}, out=tmp_path / "par", progress=False)
    assert par.summary["engine"]["engine"] == "parallel" and par.summary["status"] == "completed"
    assert par.metric("train_loss") == ref.metric("train_loss")


def test_an_augmentation_of_ones_own_mirrors_the_drawn_images_and_is_vmapped(small_config, examples_on_path,
                                                                             tmp_path):
    """examples/extending/flips.py: RandomFlip mirrors exactly the images its draw picked (by hand: a
    2x3 image and its mirror), and FedFlip trains with it as a built-in augmentation trains: the
    vectorized engine vmaps it (no fallback) and ends where the reference engine does. FedFlip's flips
    take the augmentation slot mixup would use, so mixup is refused when the method is made."""
    from flips import RandomFlip

    from fedhet.extend import Batch
    x = torch.arange(12.0).view(2, 1, 2, 3)
    batch = Batch(x, torch.tensor([0, 1]), torch.tensor([0, 1]), {})
    out = RandomFlip(0.5).apply(batch, {"flip": torch.tensor([True, False])})
    assert out.x[0, 0].tolist() == [[2.0, 1.0, 0.0], [5.0, 4.0, 3.0]]       # row by row, right to left
    assert torch.equal(out.x[1], x[1]) and torch.equal(out.y, batch.y)
    generator = torch.Generator().manual_seed(0)
    assert RandomFlip(0.0).draw(64, generator)["flip"].sum() == 0
    assert RandomFlip(1.0).draw(64, generator)["flip"].all()

    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "flips:FedFlip", "params": {"flip_p": 0.5}}
    raw["train"]["rounds"] = 2
    ref = fedhet.run(raw, {"run.engine": "reference"}, out=tmp_path / "ref", progress=False)
    vec = fedhet.run(raw, {"run.engine": "vectorized"}, out=tmp_path / "vec", progress=False)
    engine = vec.summary["engine"]
    assert engine["fallback_requests"] == 0 and engine["vectorized_requests"] > 0, engine
    for (_, a), (_, b) in zip(ref.metric("train_loss"), vec.metric("train_loss"), strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    plain = fedhet.run(raw, {"algorithm.params.flip_p": 0.0}, out=tmp_path / "plain", progress=False)
    assert plain.metric("train_loss") != ref.metric("train_loss")        # the flips reached training
    with pytest.raises(ConfigError, match="algorithm.params.mixup: fedflip cannot train with mixup"):
        make_algorithm(cfg_of(small_config, algorithm={"name": "flips:FedFlip", "params": {"mixup": True}}))


def test_forward_of_other_weights_leaves_a_methods_own_entries_out():
    """fedhet.extend.forward runs a model with weights other than its own (a teacher's, the global
    model's), binding only the entries the network has: a method's own entry beside them is ignored."""
    from fedhet.extend import forward
    from fedhet.models import build_model

    model = build_model("cnn2", 1, 10, 28).eval()
    other = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    x = torch.randn(3, 1, 28, 28)
    out = forward(model, {**other, "mymethod.temperature": torch.ones(1)}, x)
    reference = copy.deepcopy(model)
    reference.load_state_dict(other)
    features, logits = reference(x, with_features=True)
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.features, features)
    assert not torch.allclose(out.logits, model(x))        # the model's own weights were not used


@pytest.mark.parametrize(("name", "message"), [
    ("no_such_module:FedX", "no module 'no_such_module' can be imported here.*pip install -e PATH.*PYTHONPATH"),
    ("feddamp:FedNope", "module 'feddamp' .* has no 'FedNope'; it defines: FedDamp, LogitPenalty$"),
    ("feddamp:LogitPenalty", "is the class feddamp.LogitPenalty, not a method: a method is a subclass of "
                             "fedhet.extend.FedAvg"),
    ("feddamp:", "not an import path: write MODULE:NAME"),
    ("feddamp", "unknown algorithm 'feddamp'.*MODULE:CLASS"),
])
def test_a_method_that_cannot_be_used_is_a_clear_error(small_config, examples_on_path, name, message):
    with pytest.raises(ConfigError, match="algorithm.name: .*" + message):
        make_algorithm(cfg_of(small_config, algorithm={"name": name}))


def test_a_method_class_without_a_name_of_its_own_is_refused(small_config, examples_on_path, tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text(
        "from fedhet.extend import FedAvg\n\nclass Nameless(FedAvg):\n    pass\n\n"
        "def not_split(in_channels, num_classes, image_size):\n    import torch\n    return torch.nn.Linear(2, 2)\n"
        "\nraise_on_import = False\n"
        "\ndef two_arguments(num_classes, in_channels):\n    pass\n"
        "\ndef normed(in_channels, num_classes, image_size, norm='gn', hidden=8):\n"
        "    from torch import nn\n    from fedhet.extend import SplitModel\n"
        "    layer = nn.GroupNorm(2, hidden) if norm == 'gn' else nn.BatchNorm1d(hidden)\n"
        "    stages = [('flat', nn.Flatten()), ('fc', nn.Sequential(nn.Linear(in_channels * image_size ** 2, hidden), "
        "layer)),\n              ('out', nn.Linear(hidden, num_classes))]\n"
        "    return SplitModel(stages, 'out', (in_channels, image_size, image_size))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="no name of its own .*inherits 'fedavg'.*name = 'nameless'"):
        make_algorithm(cfg_of(small_config, algorithm={"name": "broken_plugin:Nameless"}))
    for arch, message in [("broken_plugin:not_split", "the builder returned a Linear \\(Linear\\(in_features=2.*not a fedhet SplitModel"),
                          ("broken_plugin:raise_on_import", "it names a bool .*not a model builder"),
                          ("broken_plugin:two_arguments", r"the builder is called as builder\(in_channels, num_classes, "
                                                          r"image_size\) \(too many positional arguments\); its "
                                                          r"signature is \(num_classes, in_channels\)"),
                          ("nets:small_mlp", None)]:
        cfg = cfg_of(small_config, model={"arch": arch, "norm": "gn"} if message is None else {"arch": arch})
        with pytest.raises(ConfigError, match=f"model {arch}: " + (message or "model.norm gn: this builder has no "
                                                                    "norm parameter to receive it; add one")):
            build_loop(cfg)
    # a builder with a norm parameter receives model.norm, as fedhet's own models do; where that
    # replaces the builder's own default (here 'gn'), the run says so
    loop = build_loop(cfg_of(small_config, model={"arch": "broken_plugin:normed", "norm": "gn"}))
    assert any(isinstance(m, torch.nn.GroupNorm) for m in loop.host.models["broken_plugin:normed"].modules())
    with pytest.warns(UserWarning, match=r"model broken_plugin:normed: the builder's own default norm='gn' is "
                                         r"replaced by model.norm 'bn'"):
        loop = build_loop(cfg_of(small_config, model={"arch": "broken_plugin:normed"}))
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in loop.host.models["broken_plugin:normed"].modules())
    with pytest.raises(ConfigError, match="model.options.norm: every model builder gets norm from model.norm; set "
                                          "model.norm instead"):
        build_loop(cfg_of(small_config, model={"arch": "broken_plugin:normed", "options": {"norm": "gn"}}))
    with pytest.raises(ConfigError, match=r"model broken_plugin:normed: model.split 'fc' is passed to the builder "
                                          r"as split=, and it has no split parameter: add one"):
        build_loop(cfg_of(small_config, model={"arch": "broken_plugin:normed", "split": "fc"}))


def test_a_module_that_raises_on_import_names_its_file_and_line(small_config, tmp_path, monkeypatch):
    (tmp_path / "exploding_plugin.py").write_text("from fedhet.extend import FedAvg\nratio = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"algorithm.name: .*importing 'exploding_plugin' raised ZeroDivisionError "
                                          r"at .*exploding_plugin.py:2: division by zero") as info:
        make_algorithm(cfg_of(small_config, algorithm={"name": "exploding_plugin:FedX"}))
    assert isinstance(info.value.__cause__, ZeroDivisionError)     # the module's own error stays in the traceback
    (tmp_path / "typo_plugin.py").write_text("from fedhet.extend import FedAvg\n\nclass FedX(FedAvg)\n    name = 'x'\n")
    with pytest.raises(ConfigError, match=r"importing 'typo_plugin' raised SyntaxError at .*typo_plugin.py:3"):
        make_algorithm(cfg_of(small_config, algorithm={"name": "typo_plugin:FedX"}))


def test_a_bug_in_a_model_builder_of_ones_own_keeps_its_traceback(small_config, tmp_path, monkeypatch):
    (tmp_path / "buggy_nets.py").write_text(
        "import torch\n\ndef shapes(in_channels, num_classes, image_size):\n"
        "    return torch.zeros(2, 3) @ torch.zeros(2, 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="model buggy_nets:shapes could not be built .*RuntimeError: mat1 and mat2") as info:
        build_loop(cfg_of(small_config, model={"arch": "buggy_nets:shapes"}))
    assert "does not fit in memory" not in str(info.value)       # a shape bug is not blamed on memory
    cause = info.value.__cause__                                   # the builder's own line stays in the traceback
    assert isinstance(cause, RuntimeError) and cause.__traceback__ is not None
    assert any(f.name == "shapes" for f in __import__("traceback").extract_tb(cause.__traceback__))


def test_a_method_refusing_the_model_is_a_config_error_that_names_both(small_config, tmp_path, monkeypatch):
    from fedhet.experiment.runner import Experiment
    (tmp_path / "narrow_nets.py").write_text(
        "from torch import nn\nfrom fedhet.extend import SplitModel\n\n"
        "def narrow(in_channels, num_classes, image_size):\n"
        "    return SplitModel([('flat', nn.Flatten()), ('fc', nn.Linear(in_channels * image_size ** 2, 4)),\n"
        "                       ('out', nn.Linear(4, num_classes, bias=False))], 'out', (in_channels, image_size, image_size))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = cfg_of(small_config, algorithm={"name": "fednh"}, model={"arch": "narrow_nets:narrow"})
    with pytest.raises(ConfigError, match=r"algorithm fednh: FedNH needs at least as many feature dimensions as "
                                          r"classes \(4 < 10\).*choose a model \(model.arch\)") as info:
        Experiment.create(cfg, tmp_path / "run")
    assert isinstance(info.value.__cause__, ValueError)         # chained: the refusing line stays in the traceback


def test_the_public_names_stay():
    """docs/extending.md promises the names of its "stable names" section; removing one breaks user
    code, so it fails here first, as does a name exported but not promised there."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    section = doc.split("## The stable names", 1)[1].split("\n## ", 1)[0]
    promised = set(re.findall(r"`(\w+)`", section.split("Anything else", 1)[0]))
    assert promised == set(fedhet.extend.__all__)
    assert {"Algorithm", "FedAvg", "LossTerm", "StreamDropout", "mixed", "ConfigError"} <= promised
    assert all(hasattr(fedhet.extend, name) for name in fedhet.extend.__all__)


def test_the_tutorials_data_sweep_and_compare_run_as_written(tmp_path):
    """docs/extending.md as a user types it, from the repository's root with examples/extending on
    PYTHONPATH: toy_arrays.py writes a dataset from arrays, the tutorial's sweep file runs FedDamp beside
    FedAvg on it (set to 1 round of the toy data instead of the quickstart's Fashion-MNIST), and
    `fedhet compare` pools each method's three seeds with per-seed differences against FedAvg."""
    import json
    import os
    import subprocess

    root = EXAMPLES.parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    said = cli("examples/extending/toy_arrays.py", str(tmp_path / "toy.npz"))
    assert f"data.dataset=npz:{tmp_path / 'toy.npz'}" in said
    cli("-m", "fedhet.cli", "sweep", "examples/extending/feddamp_vs.sweep.yaml", "--out", str(tmp_path / "sweep"),
        "--only", "fedavg", "--only", "feddamp", "--set", f"data.dataset=npz:{tmp_path / 'toy.npz'}",
        "--set", "data.pool=train", "--set", "data.partition={kind: natural}", "--set", "data.num_clients=8",
        "--set", "train.rounds=1", "--set", "train.clients_per_round=4", "--set", "train.batch_size=20",
        "--set", "run.threads=1")        # its one lane would take every CPU, beside the other test workers
    runs = [tmp_path / "sweep" / f"{tag}_s{seed}" for tag in ("fedavg", "feddamp") for seed in range(3)]
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["algorithm"] == run.name.split("_")[0], summary
    table = cli("-m", "fedhet.cli", "compare", *map(str, runs), "--paired", "fedavg")
    pooled, paired = table.split("Paired differences of final", 1)
    rows = {line.split("|")[1].strip(): line.split("|")[4].strip() for line in pooled.splitlines()
            if line.startswith("| fed")}
    assert rows == {"fedavg": "3", "feddamp": "3"}, table          # the seeds column
    difference = next(line for line in paired.splitlines() if line.startswith("| feddamp"))
    assert all(f"s{seed}: " in difference for seed in range(3)), table


def test_a_missing_name_lists_the_modules_own_names_not_its_imports(tmp_path, monkeypatch):
    from fedhet.core.plugins import load_object

    package = tmp_path / "lab_pkg"
    package.mkdir()
    (package / "methods.py").write_text("class FedX:\n    pass\n")
    (package / "__init__.py").write_text(
        "from __future__ import annotations\nimport json\nfrom pathlib import Path\nfrom typing import Any\n"
        "from .methods import FedX\nAlias = dict[str, Any]\nRATE = 0.5\ndef build():\n    return Path('.')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"has no 'Nope'; it defines: FedX, RATE, build$"):
        load_object("lab_pkg:Nope")


def test_a_resume_refuses_a_run_whose_users_code_or_data_changed_since_its_checkpoint(small_config, tmp_path,
                                                                                       monkeypatch):
    """The config names a user's method, partition and data, not what they compute: a resume finds
    a changed default of the method's parameters, a changed split and changed images through the
    checkpoint's record of what the run was built from, and refuses; the rounds done are kept."""
    import numpy as np

    from fedhet.core.errors import CheckpointError
    from fedhet.data.user_data import save_arrays
    from fedhet.experiment.runner import Experiment, read_metrics

    monkeypatch.syspath_prepend(str(tmp_path))
    method = "from fedhet.algorithms.fedavg import FedAvg\n\n\nclass Mine(FedAvg):\n    name = 'mine'\n\n" \
             "    class Params(FedAvg.Params):\n        damp: float = {}\n"
    split = "import numpy as np\n\n\ndef halves(labels, num_clients, rng):\n" \
            "    return np.array_split(np.arange(len(labels)){}, num_clients)\n"
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (160, 28, 28), dtype=np.uint8), np.arange(160) % 4

    def write(damp: str, order: str, labels: np.ndarray) -> str:
        (tmp_path / "lab_resume.py").write_text(method.format(damp))
        (tmp_path / "lab_split.py").write_text(split.format(order))
        for name in ("lab_resume", "lab_split"):
            sys.modules.pop(name, None)              # the edited file is imported anew, as by a new process
        return save_arrays(tmp_path / "arrays.npz", x, labels, x[:40], y[:40])

    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": write("1.0", "", y), "num_clients": 4, "partition": {"kind": "lab_split:halves"},
                   "local_test": {"source": "holdout", "fraction": 0.25}}
    raw["algorithm"] = {"name": "lab_resume:Mine"}
    raw["train"].update(rounds=1, clients_per_round=2, batch_size=10)
    exp = Experiment.create(load_config(raw=raw), tmp_path / "run")
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    for change, said in [(("0.5", "", y), r"the method's parameters resolve otherwise than then \(damp: 1.0 -> 0.5\)"),
                         (("1.0", "[::-1]", y), "the clients' data split differs from the one it trained on"),
                         (("1.0", "", (y + 1) % 4), "the images or labels loaded differ from those it trained on")]:
        write(*change)
        with pytest.raises(CheckpointError, match=f"cannot go on from its checkpoint of round 1: {said}"):
            Experiment.resume(exp.run_dir, run_settings=["train.rounds=2"])
        assert read_metrics(exp.run_dir) == rows
    write("1.0", "", y)                                          # as it was: it goes on
    assert Experiment.resume(exp.run_dir, run_settings=["train.rounds=2"]).run(progress=False)["rounds_completed"] == 2


def test_recorded_parameters_are_compared_as_the_method_reads_them_not_as_dumped():
    """A set dumps in the order of its hashes, which changes from one process to the next, and a
    parameter added since (a newer version) takes its default: neither is a change; a value is."""
    from pydantic import Field

    from fedhet.algorithms.fedavg import FedAvg
    from fedhet.experiment.runner import built_differently

    class Params(FedAvg.Params):
        damp: float = 1.0
        layers: set[str] = Field(default_factory=lambda: {"conv1", "fc1", "fc2"})
        added_since: int = 3

    now = Params()
    dumped = now.model_dump(mode="json")
    then = {k: v for k, v in dumped.items() if k != "added_since"}
    then["layers"] = sorted(dumped["layers"], reverse=True)
    assert built_differently({"algorithm_params": then}, {"algorithm_params": dumped}, now) is None
    then["damp"] = 0.5
    assert built_differently({"algorithm_params": then}, {"algorithm_params": dumped}, now).startswith(
        "the method's parameters resolve otherwise than then (added_since: '<absent>' -> 3; damp: 0.5 -> 1.0")
    then["damp"] = "not a number"                                   # no longer valid: a change too
    assert "damp: 'not a number' -> 1.0" in built_differently({"algorithm_params": then},
                                                              {"algorithm_params": dumped}, now)


def test_a_resume_refuses_a_run_whose_model_option_default_changed_since_its_checkpoint(small_config, tmp_path,
                                                                                         monkeypatch):
    """A model option the config leaves out takes its builder's default; a default changed since the
    checkpoint (another fedhet version, a user's builder edited) builds another model from the same
    config, so a resume names it and refuses. The options recorded hold every default filled in."""
    from dataclasses import replace
    from functools import partial

    import fedhet.models as models
    from fedhet.core.errors import CheckpointError
    from fedhet.experiment.runner import Experiment, read_metrics

    assert models.resolved_options("fca_googlenet", {}) == {"dropout": 0.2, "gn_groups": 2, "relu_features": False}
    assert models.resolved_options("fca_alexnet", {"dropout": 0}) == {"dropout": 0, "relu_features": False}
    # a user's builder: every default, written the same in every process (a function by its import
    # path, not its address) and as the config's JSON round trip gives it back (a tuple as a list)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "lab_net.py").write_text("import numpy as np\nimport torch.nn.functional as F\n\n\n"
                                         "def build(in_channels, num_classes, image_size, split=None, act=F.relu,\n"
                                         "          widths=(8, 16), scale=np.float32(0.5), norm='bn'):\n"
                                         "    raise NotImplementedError\n")
    assert models.resolved_options("lab_net:build", {"widths": (4, 4)}) == {
        "act": "torch.nn.functional:relu", "scale": 0.5, "widths": [4, 4]}
    assert models.resolved_options("lab_net:build", {"widths": [4, 4]}) == models.resolved_options(
        "lab_net:build", {"widths": (4, 4)})
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "fca_tiny_a"}
    raw["train"].update(rounds=1)
    exp = Experiment.create(load_config(raw=raw), tmp_path / "run")
    exp.run(progress=False)
    assert exp.built_from()["model_options"] == {"fca_tiny_a": {"relu_features": False}}
    rows = read_metrics(exp.run_dir)
    entry = models._MODELS["fca_tiny_a"]
    monkeypatch.setitem(models._MODELS, "fca_tiny_a", replace(entry, build=partial(entry.build, relu_features=True)))
    with pytest.raises(CheckpointError, match=r"cannot go on from its checkpoint of round 1: the models' options "
                                              r"resolve otherwise than then \(fca_tiny_a relu_features: False -> True\)"):
        Experiment.resume(exp.run_dir, run_settings=["train.rounds=2"])
    assert read_metrics(exp.run_dir) == rows
    # an option the builder has gained since the checkpoint takes its default: it goes on
    def gaining(in_channels, num_classes, image_size, split, relu_features=False, gained=0.5):
        return entry.build(in_channels, num_classes, image_size, split, relu_features=relu_features)

    monkeypatch.setitem(models._MODELS, "fca_tiny_a", replace(entry, build=gaining, options=(*entry.options, "gained")))
    resumed = Experiment.resume(exp.run_dir, run_settings=["train.rounds=1"])
    assert resumed.built_from()["model_options"] == {"fca_tiny_a": {"gained": 0.5, "relu_features": False}}
    resumed.rundir.unlock()
    monkeypatch.setitem(models._MODELS, "fca_tiny_a", entry)      # as it was: it goes on
    assert Experiment.resume(exp.run_dir, run_settings=["train.rounds=2"]).run(progress=False)["rounds_completed"] == 2


def test_a_builder_of_ones_own_must_give_one_logit_a_class_for_the_datas_images(small_config, tmp_path, monkeypatch):
    """Fewer outputs than classes failed deep in training with an IndexError; more trained logits
    that no label ever uses; a model built for other images failed at its first batch."""
    (tmp_path / "shapes_plugin.py").write_text(
        "from torch import nn\nfrom fedhet.extend import SplitModel\n\n"
        "def widths(in_channels, num_classes, image_size, outputs=None, side=None):\n"
        "    side = side or image_size\n"
        "    stages = [('flat', nn.Flatten()), ('fc', nn.Linear(in_channels * side ** 2, 8)),\n"
        "              ('out', nn.Linear(8, outputs or num_classes))]\n"
        "    return SplitModel(stages, 'out', (in_channels, side, side))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    arch = "shapes_plugin:widths"
    for options, message in [({"outputs": 2}, r"the model's head gives outputs of shape \(2,\) a sample, and the data "
                                              r"has 10 classes: its last layer must have num_classes \(10\) outputs"),
                             ({"outputs": 11}, r".*outputs of shape \(11,\) a sample, and the data has 10 classes"),
                             ({"side": 14}, r"the builder built the model for inputs of shape \(1, 14, 14\) .*and the data's "
                                            r"images are \(1, 28, 28\)")]:
        with pytest.raises(ConfigError, match=f"model {arch}: {message}"):
            build_loop(cfg_of(small_config, model={"arch": arch, "options": options}))
    model = build_loop(cfg_of(small_config, model={"arch": arch})).host.models[arch]
    assert model.training                  # the check leaves the model in the mode it was built in


def test_a_hook_misspelt_in_a_method_of_ones_own_is_said_and_a_builtin_name_refused(small_config, tmp_path,
                                                                                     monkeypatch):
    """local_term and agregate are never called (the run would be plain FedAvg's); a class named
    fedprox would be reported as FedProx."""
    (tmp_path / "typo_plugin.py").write_text(
        "from fedhet.extend import FedAvg\n\n"
        "class Typo(FedAvg):\n    name = 'typo'\n\n"
        "    def local_term(self, *args):\n        return []\n\n"
        "    def agregate(self, *args):\n        return None\n\n"
        "    def scaled_step(self, x):\n        return x\n\n"
        "class Clash(FedAvg):\n    name = 'fedprox'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_algorithm(cfg_of(small_config, algorithm={"name": "typo_plugin:Typo"}))
    said = sorted(str(w.message) for w in caught if issubclass(w.category, UserWarning))
    assert said == ["typo_plugin:Typo: Typo.agregate is no hook of FedAvg's, so fedhet never calls it (did you mean "
                    "aggregate?)",
                    "typo_plugin:Typo: Typo.local_term is no hook of FedAvg's, so fedhet never calls it (did you "
                    "mean local_terms?)"]                       # scaled_step, a helper of its own: nothing
    with pytest.raises(ConfigError, match="typo_plugin:Clash'?: its name 'fedprox' is the built-in method's, so its "
                                          "runs would be reported as that method's; give it a name of its own"):
        make_algorithm(cfg_of(small_config, algorithm={"name": "typo_plugin:Clash"}))
