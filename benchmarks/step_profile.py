"""Where one local training step's time goes: per-phase timing of ``train_local``'s step, and the top ops.

    .venv/bin/python benchmarks/step_profile.py                      # batch 32 and 10, 1 and 2 threads
    .venv/bin/python benchmarks/step_profile.py --batch 32 --threads 1 --steps 60
    .venv/bin/python benchmarks/step_profile.py --model simple_cnn --memory-format channels_last --batch 64 --threads 1

The step is the one ``fedhet.training.local.train_local`` runs (``--model``, cnn2 by default, on
Fashion-MNIST images in ``--memory-format``'s layout, plain cross-entropy, SGD with momentum 0.9),
taken apart into its phases, each timed on its own over the same ``--steps`` batches:

* ``batch``: gathering the batch's uint8 images and normalising them (``ClientData.batch``);
* ``forward``: the model with the working weights bound once, as ``train_local`` binds them;
* ``loss``: the loss terms (``total_loss``) and the terms' statistics;
* ``backward``: ``torch.autograd.grad`` of the loss;
* ``optimizer``: the SGD kernel's update (``fedhet.training.optim``).

``train_local`` itself is timed over the same steps, its passes interleaved with the phase passes;
"unaccounted" is its time per step minus the sum of the phases: the loop's bookkeeping (the finite
check, loss parts, step counters, the autocast context) and the per-call setup spread over the
steps (weight copies, optimizer state, batch order, the final checks). Medians over 5 passes; the
spread of the whole step over them is reported as min-max. The op table is ``torch.profiler``'s self CPU time over the same steps.
:func:`profile` is also called by ``benchmarks/engine_speed.py``.

``--variants`` measures exactly-equivalent rewrites of the step that were candidates for
``train_local``, each against the current step in one process, the order of the
variants rotating from one repeat to the next: every variant must give bit-identical weights and
loss after two epochs (checked; a variant that does not is reported as such), and its speed is the
ratio of median times over ``--repeats`` repeats (the min-max of its per-repeat ratios beside it):

* ``channels_last_pool``: max-pooling on a channels_last copy of its input, returned in the default
  layout (same maxima, same tie-breaking, so the same gradients);
* ``relu_then_pool``: the papers' order, ReLU before the max-pool (``relu_before_pool``); fedhet's
  builders pool first (max commutes with ReLU; a window's gradient reaches the same input either
  way), so a ratio below 1 is what pooling first gains;
* ``foreach_sgd``: the SGD update as ``torch._foreach_*`` calls over all parameters at once (on the
  CPU the same per-tensor kernels, less Python).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.nn.utils.stateless import _reparametrize_module

from fedhet.core.contract import ClientData, Forward, TrainSettings
from fedhet.core.seeding import torch_generator
from fedhet.data.datasets import load_dataset
from fedhet.experiment.summary import machine_info
from fedhet.models import build_model
from fedhet.models.base import relu_before_pool
from fedhet.training.inference import channels_last
from fedhet.training.local import epoch_batches, train_local, trains_in_channels_last
from fedhet.training.objective import CrossEntropy, accumulate_statistics, total_loss
from fedhet.training.optim import SGD, OptState, make_optimizer

PHASES = ("batch", "forward", "loss", "backward", "optimizer")


@functools.cache
def _fashion_mnist_train():  # type: ignore[no-untyped-def]
    return load_dataset("fashion_mnist")          # once per process, not once per (batch, threads)


def _data(samples: int) -> ClientData:
    train = _fashion_mnist_train()
    idx = torch.randperm(len(train), generator=torch_generator(0, "step_profile"))[:samples]
    shape = (1, len(train.mean), 1, 1)
    return ClientData(train.x, train.y, idx, torch.tensor(train.mean).view(shape), torch.tensor(train.std).view(shape))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(previous)


def profile(batch: int, threads: int, steps: int = 60, top: int = 8, arch: str = "cnn2",
            memory_format: str = "contiguous") -> dict:
    """Per-phase milliseconds of ``steps`` local steps at ``batch`` with ``threads`` intra-op threads."""
    with _threads(threads):
        return _profile(batch, threads, steps, top, arch, memory_format)


def _profile(batch: int, threads: int, steps: int, top: int, arch: str, memory_format: str) -> dict:
    data = _data(batch * steps)
    model = build_model(arch, in_channels=1, num_classes=10, image_size=28)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = TrainSettings(epochs=1, batch_size=batch, lr=0.01, momentum=0.9, drop_last=True,
                             memory_format=memory_format)
    terms = [CrossEntropy()]
    gen = lambda e: torch_generator(0, "step_profile", e)  # noqa: E731
    batches = epoch_batches(len(data.train_idx), batch, True, gen(0))
    train_local(model, weights, data, terms, settings, gen)          # warm-up (first-call allocations)

    layout = channels_last if trains_in_channels_last(settings) else (lambda t: t)

    def phases_once() -> dict[str, float]:
        spent = dict.fromkeys(PHASES, 0.0)
        work = {k: layout(v.clone()).requires_grad_(True) for k, v in weights.items()}
        opt = make_optimizer(settings)
        state = opt.load(None, list(work))
        totals: dict[str, torch.Tensor] = {}
        model.train()
        with _reparametrize_module(model, work, strict=False):
            for positions in batches:
                t0 = time.perf_counter()
                b = data.batch(positions)
                x = layout(b.x)
                t1 = time.perf_counter()
                features, logits = model(x, with_features=True)
                out = Forward(features, logits)
                t2 = time.perf_counter()
                loss, _ = total_loss(terms, out, b, work)
                with torch.no_grad():
                    accumulate_statistics(terms, out, b, totals)
                t3 = time.perf_counter()
                grads = torch.autograd.grad(loss, list(work.values()))
                t4 = time.perf_counter()
                opt.step(work, dict(zip(work, grads)), state)
                t5 = time.perf_counter()
                for name, a, z in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                    spent[name] += z - a
        return {k: 1e3 * v / len(batches) for k, v in spent.items()}

    def whole_once() -> float:
        t = time.perf_counter()
        train_local(model, weights, data, terms, settings, gen)
        return 1e3 * (time.perf_counter() - t) / len(batches)

    runs, wholes = [], []
    for _ in range(5):
        runs.append(phases_once())
        wholes.append(whole_once())
    ms = {k: statistics.median(r[k] for r in runs) for k in PHASES}
    step_ms = statistics.median(wholes)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_local(model, weights, data, terms, settings, gen)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    ops = [{"op": e.key, "share": e.self_cpu_time_total / total_us, "calls_per_step": e.count / len(batches)}
           for e in events[:top]]
    return {"batch": batch, "threads": threads, "steps": len(batches), "step_ms": step_ms,
            "step_ms_all": wholes, "samples_per_s": 1e3 * batch / step_ms, "phase_ms": ms,
            "unaccounted_ms": step_ms - sum(ms.values()), "top_ops": ops}


# --- exactly-equivalent variants of the step ---------------------------------------------------
class _ChannelsLastMaxPool2d(torch.nn.MaxPool2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.max_pool2d(x.contiguous(memory_format=torch.channels_last), self.kernel_size,
                                           self.stride, self.padding, self.dilation, ceil_mode=self.ceil_mode)
        return y.contiguous()


def _variant_model(arch: str, pool: bool = False, papers_order: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(arch, in_channels=1, num_classes=10, image_size=28)
    rewritten = 0
    if papers_order:
        model, rewritten = relu_before_pool(model)
    if pool:
        for module in model.modules():
            if not isinstance(module, torch.nn.Sequential):
                continue
            for name, p in list(module.named_children()):
                if type(p) is torch.nn.MaxPool2d:
                    setattr(module, name, _ChannelsLastMaxPool2d(p.kernel_size, p.stride, p.padding, p.dilation,
                                                                 ceil_mode=p.ceil_mode))
                    rewritten += 1
    if (pool or papers_order) and not rewritten:     # the variant would time the current step under its name
        raise SystemExit(f"step_profile.py: {arch} has no (conv, max-pool, ReLU) block for the pooling variants; "
                         "run --variants with a model that has one (cnn2, simple_cnn)")
    return model


class _ForeachSGD(SGD):
    """SGD's rule as ``torch._foreach_*`` calls over all parameters at once."""

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None], state: OptState) -> None:
        names = [n for n in params if grads.get(n) is not None]
        ps, gs = [params[n] for n in names], [grads[n] for n in names]  # type: ignore[misc]
        if self.weight_decay != 0:
            gs = torch._foreach_add(gs, ps, alpha=self.weight_decay)
        directions = gs
        if self.momentum != 0:
            old = [i for i, n in enumerate(names) if "momentum_buffer" in state[n]]
            if old:
                bufs = [state[names[i]]["momentum_buffer"] for i in old]
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, [gs[i] for i in old], alpha=1 - self.dampening)
            for i, n in enumerate(names):
                if "momentum_buffer" not in state[n]:
                    state[n]["momentum_buffer"] = gs[i].detach().clone()
            directions = [state[n]["momentum_buffer"] for n in names]
            if self.nesterov:
                directions = torch._foreach_add(gs, directions, alpha=self.momentum)
        torch._foreach_add_(ps, directions, alpha=-self.lr)


def variants(batch: int, threads: int, repeats: int = 5, samples: int = 640, arch: str = "cnn2",
             memory_format: str = "contiguous") -> list[dict]:
    """Speed of each exactly-equivalent variant relative to the current step (ratio > 1: faster)."""
    with _threads(threads):
        return _variants(batch, threads, repeats, samples, arch, memory_format)


def _variants(batch: int, threads: int, repeats: int, samples: int, arch: str, memory_format: str) -> list[dict]:
    from fedhet.training import local

    data = _data(samples)
    settings = TrainSettings(epochs=2, batch_size=batch, lr=0.05, momentum=0.9, weight_decay=1e-4,
                             memory_format=memory_format)
    gen = lambda e: torch_generator(0, "step_variants", e)  # noqa: E731
    cases = {"current": (_variant_model(arch), False),
             "channels_last_pool": (_variant_model(arch, pool=True), False),
             "relu_then_pool": (_variant_model(arch, papers_order=True), False),
             "foreach_sgd": (_variant_model(arch), True)}
    weights = {k: v.detach().clone() for k, v in cases["current"][0].state_dict().items()}

    def run(name: str):  # type: ignore[no-untyped-def]
        model, foreach = cases[name]
        if foreach:
            local.make_optimizer = lambda s: _ForeachSGD(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov)
        try:
            return train_local(model, weights, data, [CrossEntropy()], settings, gen)
        finally:
            local.make_optimizer = make_optimizer

    reference = run("current")
    exact = {name: (lambda r: r.mean_loss == reference.mean_loss
                    and all(torch.equal(r.weights[k], reference.weights[k]) for k in weights))(run(name))
             for name in cases}
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:     # rotate: no fixed first place
            t = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["current"])
    rows = []
    for name in cases:
        ratios = [c / t for c, t in zip(times["current"], times[name])]     # per repeat
        rows.append({"variant": name, "batch": batch, "threads": threads, "bit_identical": exact[name],
                     "samples_per_s": settings.epochs * samples / statistics.median(times[name]),
                     "speed_vs_current": base / statistics.median(times[name]),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "seconds_all": times[name]})
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| batch | threads | step ms (min-max) | samples/s | " + " | ".join(f"{p} ms (share)" for p in PHASES)
             + " | unaccounted ms |", "|---" * (5 + len(PHASES)) + "|"]
    for r in rows:
        cells = [f"{r['phase_ms'][p]:.2f} ({r['phase_ms'][p] / r['step_ms']:.0%})" for p in PHASES]
        spread = f" ({min(r['step_ms_all']):.1f}-{max(r['step_ms_all']):.1f})" if r.get("step_ms_all") else ""
        lines.append(f"| {r['batch']} | {r['threads']} | {r['step_ms']:.2f}{spread} | {r['samples_per_s']:.0f} | "
                     + " | ".join(cells) + f" | {r['unaccounted_ms']:.2f} |")
    for r in rows:
        ops = ", ".join(f"{o['op']} {o['share']:.0%}" for o in r["top_ops"])
        lines.append(f"\nTop ops by self CPU time, batch {r['batch']}, {r['threads']} thread(s): {ops}.")
    return "\n".join(lines) + "\n"


def variants_report(rows: list[dict]) -> str:
    lines = ["| variant | batch | threads | bit-identical | samples/s | speed vs current | per-repeat min-max |",
             "|---" * 7 + "|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['threads']} | {'yes' if r['bit_identical'] else 'NO'} | "
                     f"{r['samples_per_s']:.0f} | {r['speed_vs_current']:.3f} | "
                     f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="cnn2", help="a model of fedhet.models built for Fashion-MNIST (cnn2)")
    p.add_argument("--memory-format", default="contiguous", choices=("contiguous", "channels_last"),
                   help="the layout local training runs in (run.memory_format)")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 10])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--variants", action="store_true", help="also time the exactly-equivalent variants")
    p.add_argument("--repeats", type=int, default=5, help="alternations of the variants")
    p.add_argument("--out", type=Path, help="also write the rows as JSON here")
    a = p.parse_args()
    rows = [profile(b, t, a.steps, arch=a.model, memory_format=a.memory_format) for b in a.batch for t in a.threads]
    print(report(rows))
    tried = [v for b in a.batch for t in a.threads
             for v in variants(b, t, a.repeats, arch=a.model, memory_format=a.memory_format)] if a.variants else []
    if tried:
        print(variants_report(tried))
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "memory_format": a.memory_format, "machine": machine_info(),
                                     "profile": rows, "variants": tried}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
