"""Helpers shared by the tests (one place for each): configs, loops built like the runner builds
them, round contexts, and exact / tolerant comparison of nested states."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from fedhet.core.contract import RoundContext
from fedhet.data.federated import build_federation
from fedhet.engine import ClientHost, RoundLoop
from fedhet.engine.host import Tally
from fedhet.experiment.build import build_models, make_algorithm, train_settings
from fedhet.experiment.config import load_config
from fedhet.models.base import SplitModel

# Debian's dataset-fashion-mnist (``apt-get install dataset-fashion-mnist``): tests on the real
# images skip where it is not installed.
REAL_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def small_config_in(data_root: Path, out_dir: Path) -> dict:
    """A raw config dict for a fast end-to-end FedAvg run on the synthetic data under ``data_root``."""
    return {
        "name": "tiny",
        "seed": 3,
        "data": {"root": str(data_root), "verify": False, "num_clients": 6,
                 "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 20},
                 "local_test": {"source": "test_set", "fraction": 0.2}},
        "model": {"arch": "cnn2"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 3, "clients_per_round": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 1, "final_window": 2},
        "run": {"out_dir": str(out_dir), "checkpoint_every": 2, "progress": False},
    }


def config(small_config: dict, algorithm: str = "fedavg", params: dict | None = None, **train):
    """``small_config`` with another algorithm and train settings, validated."""
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": algorithm, "params": dict(params or {})}
    raw["train"].update(train)
    return load_config(raw=raw)


def build_host(cfg, fed=None, models=None, algorithm=None, precision: str = "fp32") -> ClientHost:
    fed = fed or build_federation(cfg.data, cfg.seed)
    built_models, client_arch = build_models(cfg, fed)
    return ClientHost(algorithm or make_algorithm(cfg), fed, models or built_models, client_arch,
                      train_settings(cfg, precision), cfg.seed, lr_decay=cfg.train.lr_decay)


def build_loop(cfg, transport=None, **host_options) -> RoundLoop:
    """A round loop built as the runner builds it, on ``transport`` (default: in-process)."""
    return RoundLoop(build_host(cfg, **host_options), cfg.train.clients_per_round, transport)


def ctx(clients, num_classes: int = 10, rnd: int = 0, num_clients: int | None = None, sizes=None,
        evaluating: bool = False) -> RoundContext:
    """A round context by hand (sizes: one int for all clients, a dict, or None for 100 each)."""
    n = num_clients or (max(clients) + 1)
    if sizes is None or isinstance(sizes, int):
        sizes = {c: sizes or 100 for c in range(n)}
    return RoundContext(round=rnd, clients=list(clients), num_clients=n, num_classes=num_classes,
                        client_sizes=sizes, rng=np.random.default_rng(0), evaluating=evaluating)


def train_call_view(client, epochs=None, data=None, settings=None):
    """``(data, settings)`` a fake ClientRuntime's ``train`` trains with: another data view and other
    settings where the call gives them (ClientRuntime.train's options), ``epochs`` over either."""
    s = settings if settings is not None else client.settings
    if epochs is not None:
        s = replace(s, epochs=epochs)
    return (data if data is not None else client.data), s


def runtime(loop: RoundLoop, cid: int, rnd: int = 0):
    """The in-process client runtime of ``cid`` in round ``rnd`` (a fresh round tally)."""
    return loop.host.runtime(cid, rnd, Tally())


def assert_identical(a, b, where: str = "state") -> None:
    """Exact equality of nested states: tensors bit for bit (dtype and shape too). For runs of the same
    arithmetic in the same order (the parallel engine's workers, Flower's transport): their rounding,
    a zero-gradient tensor's noise included, is then the same too."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"     # NaN equals NaN here


def assert_close(a, b, atol: float, rtol: float = 1e-5, where: str = "state", atol_for=None,
                 leave_out=None) -> None:
    """Nested states equal to float tolerance (integer tensors and plain non-float values exactly;
    Python floats to rel 1e-3).
    ``atol_for(where)``, if given, picks the tolerance per entry (e.g. looser for control variates);
    ``leave_out(where)``, if given and true, leaves a floating-point entry uncompared (the caller holds
    it another way: ``ZeroGradientBounds``)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        if a.is_floating_point() and leave_out and leave_out(where):
            assert a.shape == b.shape, where
        elif a.is_floating_point():
            tol = atol_for(where) if atol_for else atol
            torch.testing.assert_close(b, a, atol=tol, rtol=rtol, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_close(a[k], b[k], atol, rtol, f"{where}.{k}", atol_for, leave_out)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, atol, rtol, f"{where}[{i}]", atol_for, leave_out)
    elif isinstance(a, float):          # statistics computed from the weights (FedACD's KL per client)
        import pytest

        assert b == pytest.approx(a, rel=1e-3, abs=atol_for(where) if atol_for else atol), where
    else:
        assert a == b, where


def deliver(loop: RoundLoop, cid: int, msg, rnd: int, stats):
    """One client's message through the loop, as a one-client phase; its reply."""
    return loop.deliver_phase({cid: msg}, rnd, stats)[cid]


def run_killed_in_round(exp, monkeypatch, rnd: int) -> None:
    """Run ``exp`` until a KeyboardInterrupt hits it at the start of 0-based round ``rnd`` (as a
    kill would); the rounds before are recorded and checkpointed as in a real run."""
    import pytest

    real = exp.loop.run_round

    def interrupted(r, *args):
        if r == rnd:
            raise KeyboardInterrupt
        return real(r, *args)

    monkeypatch.setattr(exp.loop, "run_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exp.run(progress=False)


def bn_model(projection_dim=None, split="fc2", batch_norm: bool = True, channels: int = 1,
             size: int = 28) -> SplitModel:
    """A small CNN with BatchNorm for ``channels`` x ``size`` x ``size`` inputs (default 1x28x28; the
    library's BN models are the ResNets, too slow for most tests).

    Smooth (tanh, average pooling): no ReLU kink or max-pool tie for rounding to flip, so the
    engine-equivalence tests hold it to rounding (their TIGHT). ``batch_norm=False`` leaves the
    BatchNorm layers out (Identity): a convolution's bias before BatchNorm has an exactly zero
    gradient, i.e. rounding noise, which Adam's normalisation blows up to steps of lr.
    """
    torch.manual_seed(11)
    side = ((size - 2) // 2 - 2) // 2      # after two 3x3 convolutions, each followed by 2x2 pooling

    def norm(width: int) -> nn.Module:
        return nn.BatchNorm2d(width) if batch_norm else nn.Identity()

    stages = [
        ("conv1", nn.Sequential(nn.Conv2d(channels, 8, 3), norm(8), nn.Tanh(), nn.AvgPool2d(2))),
        ("conv2", nn.Sequential(nn.Conv2d(8, 16, 3), norm(16), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten())),
        ("fc1", nn.Sequential(nn.Linear(16 * side * side, 64), nn.Tanh())),
        ("fc2", nn.Linear(64, 10)),
    ]
    model = SplitModel(stages, split, (channels, size, size))
    if projection_dim:
        model.add_projection(projection_dim)
    return model


# --- tensors whose gradient is zero by construction -----------------------------------------------

UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2      # 2**-24: IEEE binary32 on every CPU and GPU
# Entries computed from a parameter's drift or gradient rather than holding its value: SCAFFOLD's
# control variates (drift / (lr * K)), momentum buffers and kept optimizer state (gradients).
DERIVED_ENTRIES = (".control.", ".momentum.", ".optimizer_state.")


def zero_gradient_parameters(model: nn.Module, input_shape=None) -> dict[str, frozenset[str]]:
    """The parameters on which ``model``'s training-mode output does not depend, each with the
    floating-point buffers its value flows into.

    Found from the model itself, not from a list of names: on a float64 copy in train mode, each
    parameter tensor in turn is moved by a random offset of unit scale and a batch of 4 random inputs
    is run forward; where the features and the logits stay put to float64 rounding, the parameter
    is one no loss of the model's output can have a gradient for. The case in fedhet's tests is a
    convolution's bias in front of BatchNorm (bn_model): BatchNorm in train mode subtracts the
    batch mean, which holds the bias, so its gradient is exactly zero and what autograd returns is
    rounding. Its value still reaches the BatchNorm's running mean, which the probe reports beside
    it. (fedhet's own BatchNorm models put bias-free convolutions there; a Linear bias before a
    softmax, or a bias before GroupNorm with several channels a group, has one zero direction, not
    a zero tensor, and its other directions carry real gradients: not reported.)
    """
    probe = copy.deepcopy(model).double().train()
    start = copy.deepcopy(probe.state_dict())
    shape = tuple(input_shape or model.input_shape)
    x = torch.randn((4, *shape), generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def run() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            out = probe(x, with_features=True) if isinstance(probe, SplitModel) else (probe(x),)
        buffers = {k: v.clone() for k, v in probe.named_buffers() if v.is_floating_point()}
        probe.load_state_dict(start)
        return list(out), buffers

    def moved(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a - b).abs().max() > 1e-9 * (1.0 + float(a.abs().max())))

    base_out, base_buffers = run()
    found = {}
    for name, p in probe.named_parameters():
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
        out, buffers = run()
        if not any(moved(a, b) for a, b in zip(base_out, out)):
            found[name] = frozenset(k for k in buffers if moved(base_buffers[k], buffers[k]))
    return found


def tensors_digest(tensors) -> str:
    """A sha256 over tensors (one, or nested in dicts / lists, in order), their shapes and dtypes."""
    h = hashlib.sha256()

    def add(t):
        if isinstance(t, dict):
            for k in sorted(t):
                h.update(str(k).encode())
                add(t[k])
        elif isinstance(t, (list, tuple)):
            for item in t:
                add(item)
        else:
            t = t.detach().cpu().contiguous()
            h.update(f"{tuple(t.shape)} {t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    add(tensors)
    return h.hexdigest()


_TERM_SUMS: dict[tuple[str, str, str, str], float] = {}


def largest_term_sum(model: nn.Module, name: str, fed, states) -> float:
    """:func:`measured_largest_term_sum`, computed once per process for each model (its structure,
    as ``repr`` prints it), bias, federation (every client's normalised training inputs and labels,
    what it reads) and list of states: a pure function of those, which the vectorized engine's
    tests ask for again and again with the same initial model and data."""
    clients = [fed.client_data(cid) for cid in range(fed.num_clients)]
    data = tensors_digest([[c.inputs(c.train_idx), c.y[c.train_idx]] for c in clients])
    key = (name, repr(model), tensors_digest(list(states)), data)
    if key not in _TERM_SUMS:
        _TERM_SUMS[key] = measured_largest_term_sum(model, name, fed, states)
    return _TERM_SUMS[key]


def measured_largest_term_sum(model: nn.Module, name: str, fed, states) -> float:
    """For the bias ``name`` of a Conv / Linear layer: S, the largest sum of absolute terms one sample
    contributes to that bias's gradient, max over channels, over every client's training samples
    and over the model ``states``.

    The bias's gradient in a batch of b samples is the sum over its samples and positions of
    d loss / d output, the batch-mean loss's 1/b included, so no batch's sum of absolute terms
    exceeds S. Measured with cross-entropy, the data term through which every method trains the
    body, in train mode on a copy (BatchNorm statistics over the client's whole set instead of one
    batch's: S is a scale, and the largest sample's is several times a batch's mean)."""
    layer_name, _, leaf = name.rpartition(".")
    probe = copy.deepcopy(model).train()
    layer = probe.get_submodule(layer_name)
    if leaf != "bias" or not isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
        raise ValueError(f"{name}: no rounding bound derived for a zero-gradient tensor other than a "
                         "Conv / Linear bias")
    kept = {}
    hook = layer.register_forward_hook(lambda module, args, out: kept.__setitem__("out", out))
    largest = 0.0
    try:
        for state in states:
            probe.load_state_dict(state)
            for cid in range(fed.num_clients):
                data = fed.client_data(cid)
                logits = probe(data.inputs(data.train_idx))
                loss = nn.functional.cross_entropy(logits, data.y[data.train_idx], reduction="sum")
                (delta,) = torch.autograd.grad(loss, [kept["out"]])
                terms = delta.detach().abs()
                largest = max(largest, float((terms.flatten(2).sum(2) if terms.dim() > 2 else terms).max()))
    finally:
        hook.remove()
    return largest


class ZeroGradientBounds:
    """How far a parameter whose gradient is zero by construction (``zero_gradient_parameters``)
    may legitimately move, and so differ between two engines, after SGD training.

    Such a parameter's value after training is its start plus lr times rounding noise: comparing
    two engines' values at an absolute tolerance compares that noise, which moves whenever the
    summation order does (vmap's batched reductions, another CPU's vector width, a GPU kernel), so
    it fails at random. What may legitimately happen to it, step by step:

    * its gradient is a sum of terms (d loss / d output over the batch's samples and positions) that
      cancels exactly, and so are the two means of BatchNorm's backward that feed those terms. A
      sum's rounding error is sum_k delta_k * s_k over its partial sums s_k, |delta_k| <= u = 2**-24
      whatever the order (the engines', a CPU's vector width, a GPU's tree); with the rounding errors
      of independent sign (Higham & Mary 2019, probabilistic rounding error analysis) it stays within
      lambda * u * sqrt(sum_k s_k**2) but for a probability below 2 exp(-lambda**2 / 2), 4e-6 at
      lambda = 5. Terms centred by BatchNorm add up like a random walk, whose partial sums give
      sqrt(sum_k s_k**2) of about 0.9 of the sum of absolute terms, and none of those exceeds S
      (``largest_term_sum``: the largest one sample contributes, a batch's mean of them no more).
      So G = 3 * lambda * u * S bounds the gradient's noise in every step; the noise measured on
      the bn_model is about 1.5 u S, a batch's own S included;
    * weight decay wd adds wd * |p| to that gradient (the same pull in both engines, up to rounding,
      but counted whole);
    * momentum beta carries a step's gradient into later ones: at most 1 / (1 - beta) of it;
    * the update p - lr * v rounds once (u * |p|) and each round's averaging over m clients at
      most m + 1 times.

    Terms that read the parameter itself are not counted: FedProx's pull towards a global model
    that is within D itself, and SCAFFOLD's correction by controls that are this same noise over
    lr * K (a step's move at most tripled a round, which the margin over the measured noise covers
    for the tests' two or three rounds).

    So each engine's value stays within D = T * (lr * (G + wd * |p|) / (1 - beta) + u * |p|) +
    R * (m + 1) * u * |p| of the start, T the most local steps a model can have taken (the sum over
    the R rounds of the round's most steps of any client; averaging is convex, so a global model
    stays within the same D), |p| the largest magnitude of the parameter anywhere. That is what is
    held (``check``): each engine's value within D of the start, and the BatchNorm running means
    the value flows into (``zero_gradient_parameters``) to the other entries' tolerance plus 2 D.
    Derived entries (``DERIVED_ENTRIES``: controls, momentum, optimizer state) of such a parameter
    are its drift over lr * K or its noise gradient: rounding and nothing else, they are left out
    of the comparison; the value they come from is held.

    A wrong update shows: a real gradient (of order 1e-2 on the bn_model's weights) moves a tensor
    by lr times that in one step, tens of times D, and a value written over it (a reset, another
    channel's, a NaN) leaves D behind. For Adam, which divides
    the noise by its own running size and so turns it into steps of order lr, no bound is derived:
    the tests train Adam on models without such tensors (bn_model(batch_norm=False)).
    """

    LAMBDA = 5.0        # the probabilistic rounding bound's lambda
    SUMS = 3            # the bias's own sum and BatchNorm backward's two means

    def __init__(self, loop, steps_per_round: list[int]):
        settings = loop.host.settings
        self.names: dict[str, frozenset[str]] = {}
        self.starts: dict[str, torch.Tensor] = {}
        self.noise: dict[str, float] = {}
        for arch, model in loop.host.models.items():
            found = zero_gradient_parameters(model)
            if found and settings.optimizer != "sgd":
                raise ValueError(f"{sorted(found)}: zero-gradient tensors under {settings.optimizer}, which "
                                 "turns their rounding noise into steps of order lr; no bound derived")
            init = loop.host.init_models[arch]
            for name, buffers in found.items():
                s = largest_term_sum(model, name, loop.federation, [init])
                g = self.SUMS * self.LAMBDA * UNIT_ROUNDOFF * s
                self.names[name] = self.names.get(name, frozenset()) | buffers
                self.starts[name] = init[name]
                self.noise[name] = max(self.noise.get(name, 0.0), g)
        self.settings = settings
        self.steps = sum(steps_per_round)
        self.rounds = len(steps_per_round)
        self.clients = loop.clients_per_round

    def drift(self, name: str, magnitude: float) -> float:
        """D for parameter ``name`` whose largest magnitude is ``magnitude`` (class docstring)."""
        s, u = self.settings, UNIT_ROUNDOFF
        carry = 1.0 / (1.0 - s.momentum)
        return (self.steps * (s.lr * carry * (self.noise[name] + s.weight_decay * magnitude) + u * magnitude)
                + self.rounds * (self.clients + 1) * u * magnitude)

    def owner(self, where: str) -> str | None:
        """The zero-gradient parameter whose value (or derived entry) ``where`` is, if any."""
        return next((n for n in self.names if where.endswith("." + n)), None)

    def leave_out(self, where: str) -> bool:
        """For ``assert_close``: the entries held by ``check`` instead, and the derived ones."""
        return self.owner(where) is not None

    def extra_atol(self, where: str) -> float:
        """What a buffer fed by a zero-gradient parameter (its BatchNorm running mean) may differ by
        beyond the engines' tolerance: 2 D of the parameter that feeds it."""
        return max((2 * self.drift(n, 2 * float(self.starts[n].abs().max()))
                    for n, buffers in self.names.items() for b in buffers if where.endswith("." + b)), default=0.0)

    def check(self, a, b, where: str = "state") -> None:
        """Each zero-gradient parameter's value in nested states ``a`` and ``b`` (two engines') within
        D of its start; derived entries are not compared (class docstring)."""
        for path, x, y in _float_pairs(a, b, where):
            name = self.owner(path)
            if name is None or any(d in path for d in DERIVED_ENTRIES):
                continue
            start = self.starts[name]
            magnitude = max(float(t.abs().max()) for t in (start, x, y))
            bound = self.drift(name, magnitude)
            for engine, value in (("first", x), ("second", y)):
                moved = float((value - start).abs().max())
                assert moved <= bound, (f"{path}: the {engine} state's value moved {moved:.3e} from its start, "
                                        f"beyond what rounding can move a zero-gradient tensor ({bound:.3e})")


def _float_pairs(a, b, where: str):
    """(path, a's tensor, b's tensor) for every floating-point tensor of nested states ``a``, ``b``."""
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            yield where, a, b
    elif isinstance(a, dict):
        for k in a:
            yield from _float_pairs(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _float_pairs(x, y, f"{where}[{i}]")


def benchmark_script(name: str):
    """The module of ``benchmarks/<name>.py`` (a script, not a package), for testing the figures it prints."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(folder: Path, rows: list[dict]) -> None:
    """A run folder's metrics.jsonl holding ``rows``, one JSON object a line (as a run writes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_sweep(tmp_path, small_config, runs, **extra):
    """Two tiny configs (fedavg, fedprox) and a sweep file over them."""
    paths = {}
    for algo in ("fedavg", "fedprox"):
        raw = copy.deepcopy(small_config)
        raw["algorithm"] = {"name": algo}
        raw["train"]["rounds"] = 3
        paths[algo] = tmp_path / f"{algo}.yaml"
        paths[algo].write_text(yaml.safe_dump(raw))
    spec = {"name": "tiny", "out": str(tmp_path / "out"), "lanes": 2, "seeds": [0],
            "runs": [{"config": str(paths[a]) if a in paths else a, **opts} for a, opts in runs], **extra}
    path = tmp_path / "tiny.sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def conv_layouts(model: nn.Module, of: str = "input") -> list[bool]:
    """A list that records, per convolution call of ``model`` from now on, whether its ``of``
    ("input" or "weight") was in channels_last (channel stride 1, which the default layout has only
    for one-pixel images and 1x1 kernels)."""
    seen: list[bool] = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_pre_hook(lambda mod, args: seen.append(
                (args[0] if of == "input" else mod.weight).stride(1) == 1))
    return seen


def module_of_ones_own(tmp_path: Path, monkeypatch, name: str, source: str) -> Path:
    """A user's module ``name`` written into ``tmp_path`` and importable for the test (its folder on
    sys.path); imported anew, and gone from sys.modules when the test ends."""
    import sys

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    # setitem records the module as absent, so monkeypatch's undo removes whatever the test imported
    monkeypatch.setitem(sys.modules, name, None)
    del sys.modules[name]
    return path


def write_leaf_femnist(root: Path, writers: dict[str, tuple[list[int], list[int]]]) -> Path:
    """LEAF FEMNIST files under ``root/femnist``: ``writers`` maps a writer's name to its (train,
    test) labels; every image is blank but for its writer's number and position in its first pixels."""
    for split, at in (("train", 0), ("test", 1)):
        users = {}
        for w, (name, labels) in enumerate(writers.items()):
            ys = labels[at]
            if ys:
                x = np.zeros((len(ys), 784))
                x[:, 0], x[:, 1], x[:, 2] = (w + 1) / 255, np.arange(len(ys)) / 255, at / 255
                users[name] = {"x": x.tolist(), "y": list(ys)}
        doc = {"users": list(users), "num_samples": [len(u["y"]) for u in users.values()], "user_data": users}
        (root / "femnist" / split).mkdir(parents=True, exist_ok=True)
        (root / "femnist" / split / f"all_data_0_niid_{split}.json").write_text(json.dumps(doc))
    return root
