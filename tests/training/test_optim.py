"""The optimizer kernels (fedhet.training.optim) are bit-identical to torch.optim on the CPU, and
local training no longer pulls in torch._dynamo (torch.optim.Optimizer.step imports it)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from fedhet.core.contract import TrainSettings
from fedhet.training.optim import SGD, Adam, clip_grad_norm, make_optimizer


def _params():
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(5, 4, generator=g), "a.bias": torch.randn(5, generator=g),
            "b.weight": torch.randn(3, 5, generator=g), "frozen": torch.randn(2, generator=g)}


def _run(kernel, torch_opt_factory, steps=6, clip=None, state_in=None):
    """Same gradients into both; returns (kernel params, kernel state, torch params, torch opt)."""
    init = _params()
    trainable = ["a.weight", "a.bias", "b.weight"]       # "frozen" is not among the leaves
    mine = {k: init[k].clone() for k in trainable}
    ref = {k: init[k].clone().requires_grad_(True) for k in trainable}
    opt = torch_opt_factory([ref[k] for k in trainable])
    state = kernel.init_state(trainable) if state_in is None else state_in
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        grads = {k: torch.randn(mine[k].shape, generator=g) * (1 + step) for k in trainable}
        if step == 2:
            grads["a.bias"] = None                      # no gradient: no step, state kept (torch skips it)
        for k in trainable:
            ref[k].grad = None if grads[k] is None else grads[k].clone()
        if clip is not None:
            clip_grad_norm([v for v in grads.values() if v is not None], clip)
            torch.nn.utils.clip_grad_norm_([ref[k] for k in trainable], clip)
        kernel.step(mine, grads, state)
        opt.step()
    return mine, state, ref, opt


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=5e-3),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
]


@pytest.mark.parametrize("kw", SGD_CASES)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_sgd_bit_identical_to_torch(kw, clip):
    mine, state, ref, opt = _run(SGD(**kw), lambda ps: torch.optim.SGD(ps, foreach=False, **kw), clip=clip)
    for k in mine:
        assert torch.equal(mine[k], ref[k].detach()), k
        buf = opt.state[ref[k]].get("momentum_buffer")
        if buf is None:
            assert "momentum_buffer" not in state[k]
        else:
            assert torch.equal(state[k]["momentum_buffer"], buf), k


def test_sgd_kept_state_round_trips_by_parameter_name():
    kernel = SGD(lr=0.1, momentum=0.9)
    _, state, ref, opt = _run(kernel, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False))
    exported = kernel.export(state)
    assert set(exported) == {"a.weight", "a.bias", "b.weight"}
    # Continue from the exported buffers == continue the torch optimizer.
    loaded = kernel.load(exported, list(exported))
    g = torch.Generator().manual_seed(99)
    mine = {k: ref[k].detach().clone() for k in ref}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in mine.items()}
    for k in ref:
        ref[k].grad = grads[k].clone()
    kernel.step(mine, grads, loaded)
    opt.step()
    assert all(torch.equal(mine[k], ref[k].detach()) for k in mine)


ADAM_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
    dict(lr=3e-3, weight_decay=1e-3, amsgrad=True),
]


@pytest.mark.parametrize("kw", ADAM_CASES)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_adam_bit_identical_to_torch(kw, clip):
    kernel = Adam(**kw)
    mine, state, ref, opt = _run(kernel, lambda ps: torch.optim.Adam(ps, foreach=False, **kw), clip=clip)
    for k in mine:
        assert torch.equal(mine[k], ref[k].detach()), k
        ts = opt.state[ref[k]]
        assert torch.equal(state[k]["exp_avg"], ts["exp_avg"]) and torch.equal(state[k]["exp_avg_sq"], ts["exp_avg_sq"])
        assert float(state[k]["step"]) == float(ts["step"])
    # The flat export carries every slot and loads back unchanged.
    back = kernel.load(kernel.export(state), list(state))
    assert all(torch.equal(back[k][s], state[k][s]) for k in state for s in state[k])


def test_make_optimizer_reads_settings():
    s = TrainSettings(epochs=1, batch_size=4, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    opt = make_optimizer(s)
    assert isinstance(opt, SGD) and opt.nesterov and opt.momentum == 0.9
    a = make_optimizer(TrainSettings(epochs=1, batch_size=4, lr=0.1, optimizer="adam", betas=(0.5, 0.6)))
    assert isinstance(a, Adam) and (a.beta1, a.beta2) == (0.5, 0.6)
    with pytest.raises(ValueError):
        make_optimizer(TrainSettings(epochs=1, batch_size=4, lr=0.1, optimizer="lbfgs"))


def test_train_local_with_adam_equals_plain_torch():
    from fedhet.core.contract import ClientData
    from fedhet.core.seeding import torch_generator
    from fedhet.models import build_model
    from fedhet.training.local import epoch_batches, train_local
    from fedhet.training.objective import CrossEntropy

    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
    x = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8)
    y = torch.randint(0, 10, (40,))
    data = ClientData(x, y, torch.arange(40), torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.3))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    s = TrainSettings(epochs=1, batch_size=16, lr=1e-3, weight_decay=1e-4, optimizer="adam", clip_grad_norm=1.0)

    def gen(e):
        return torch_generator(1, "batches", e)

    result = train_local(model, weights, data, [CrossEntropy()], s, gen)
    ref = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
    ref.load_state_dict(weights)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3, weight_decay=1e-4, foreach=False)
    for pos in epoch_batches(40, 16, False, gen(0)):
        b = data.batch(pos)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(b.x), b.y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(result.weights[name], p, rtol=1e-5, atol=1e-6)
    assert {k.rsplit("/", 1)[1] for k in result.optimizer_state} == {"step", "exp_avg", "exp_avg_sq"}


def test_local_training_does_not_import_dynamo():
    """torch.optim.Optimizer.step imports torch._dynamo on first use (seconds, hundreds of MB);
    local training with the functional kernels must not."""
    code = textwrap.dedent("""
        import sys, torch
        from fedhet.core.contract import ClientData, TrainSettings
        from fedhet.core.seeding import torch_generator
        from fedhet.models import build_model
        from fedhet.training.local import train_local
        from fedhet.training.objective import CrossEntropy
        model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
        data = ClientData(torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8), torch.randint(0, 10, (20,)),
                          torch.arange(20), torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.3))
        w = {k: v.clone() for k, v in model.state_dict().items()}
        s = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3, clip_grad_norm=1.0)
        r = train_local(model, w, data, [CrossEntropy()], s, lambda e: torch_generator(0, "b", e))
        assert r.steps == 3
        assert "torch._dynamo" not in sys.modules, "local training imported torch._dynamo"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
