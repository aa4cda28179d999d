"""The optimizer kernels of local training, as plain tensor arithmetic.

One definition of each update rule, used by :func:`fedhet.training.local.train_local` on one
client's tensors and, for SGD, by the vectorized engine on tensors stacked over clients (the
arithmetic is elementwise, so a leading client dimension changes nothing but the per-client first
step). For Adam the vectorized engine shares :meth:`Adam.moments` and :meth:`Adam.corrections`
and takes the bias corrections of each step from its schedule (``Vectorized._adam``):

* :class:`SGD` - ``torch.optim.SGD`` (lr, momentum, dampening, weight_decay, nesterov);
* :class:`Adam` - ``torch.optim.Adam`` (lr, betas, eps, weight_decay, amsgrad);
* :func:`clip_grad_norm` - ``torch.nn.utils.clip_grad_norm_`` (total 2-norm over the gradients).

Each is written op for op after torch's single-tensor ("for-loop", ``foreach=False``)
implementation, the one the CPU uses, so the results are bit-identical to torch's on the CPU
(tests/training/test_optim.py checks it with ``torch.equal``). Using them instead of ``torch.optim``
keeps local training free of ``torch.optim.Optimizer.step``, which imports ``torch._dynamo``
(several seconds and ~hundreds of MB) on first use.

State is a dict ``{parameter name: {slot: tensor}}``; a frozen parameter is simply not among
the parameters passed in and has no state. A parameter whose gradient is None takes no step and
keeps its state, as in torch. :meth:`Optimizer.export` / :meth:`Optimizer.load` turn it into the
flat ``Arrays`` of ``LocalResult.optimizer_state``: for SGD ``{name: momentum buffer}`` (as
before), for Adam ``{"<name>/<slot>": tensor}`` with slots ``step``, ``exp_avg``,
``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fedhet.core.contract import Arrays, TrainSettings

OptState = dict[str, dict[str, torch.Tensor]]


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place so their total 2-norm is at most ``max_norm``; returns the norm
    before clipping. ``torch.nn.utils.clip_grad_norm_`` (same ops, same order)."""
    if not grads:
        return torch.tensor(0.0)
    norms = torch._foreach_norm(grads, 2.0)
    total = torch.linalg.vector_norm(torch.stack(list(norms)), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return total  # type: ignore[no-any-return]


def clip_coefficient(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The clipping factor of :func:`clip_grad_norm` from per-parameter norms stacked on dim 0
    (any trailing dims, e.g. one per client)."""
    total = torch.linalg.vector_norm(norms, 2.0, dim=0)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


class Optimizer:
    """Interface of the kernels: ``init_state(names)``, ``step(params, grads, state)``."""

    slots: tuple[str, ...] = ()

    def init_state(self, names: Iterable[str]) -> OptState:
        return {n: {} for n in names}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None], state: OptState) -> None:
        """One update of every parameter with a gradient (a None gradient: no step, state kept)."""
        for name, p in params.items():
            g = grads.get(name)
            if g is not None:
                self.update(p, g, state[name])

    def update(self, p: torch.Tensor, g: torch.Tensor, s: dict[str, torch.Tensor]) -> None:
        """One parameter's update, in place, with its state slots ``s``."""
        raise NotImplementedError

    def export(self, state: OptState) -> Arrays:
        out = {}
        for name, slots in state.items():
            for slot, t in slots.items():
                out[f"{name}/{slot}"] = t.detach().clone(memory_format=torch.contiguous_format)
        return out

    def load(self, arrays: Arrays | None, names: Iterable[str]) -> OptState:
        state = self.init_state(names)
        for name in state:
            for slot in self.slots:
                t = (arrays or {}).get(f"{name}/{slot}")
                if t is not None:
                    # Adam's step counter stays a CPU float, as in torch.optim.Adam: update() reads it
                    # with .item(), which on a device would wait for the device at every update.
                    state[name][slot] = t.detach().to("cpu", torch.float32).clone() if slot == "step" else t.clone()
        return state


class SGD(Optimizer):
    """``torch.optim.SGD`` (single-tensor path), per parameter:

    ``g += wd * p``; with momentum ``buf = g`` on the first step, else
    ``buf = momentum * buf + (1 - dampening) * g``; ``d = g + momentum * buf`` (Nesterov) or
    ``buf``; ``p -= lr * d``.
    """

    slots = ("momentum_buffer",)

    def __init__(self, lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.lr, self.momentum, self.dampening = float(lr), float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)

    def direction(self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None,
                  had: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(update direction, new momentum buffer)`` for one (possibly client-stacked) tensor.

        ``buf`` None: first step (the buffer starts as the gradient). ``had``: a bool mask
        broadcastable to ``g`` saying which clients already have a buffer (the others start
        theirs from the gradient); None means all or none, by ``buf``."""
        if self.weight_decay != 0:
            g = g.add(p, alpha=self.weight_decay)
        if self.momentum == 0:
            return g, None
        if buf is None:
            new = g.detach().clone()
        else:
            new = buf.mul(self.momentum).add_(g, alpha=1 - self.dampening)
            if had is not None:
                new = torch.where(had, new, g)
        d = g.add(new, alpha=self.momentum) if self.nesterov else new
        return d, new

    def update(self, p: torch.Tensor, g: torch.Tensor, s: dict[str, torch.Tensor]) -> None:
        d, buf = self.direction(p, g, s.get("momentum_buffer"))
        if buf is not None:
            s["momentum_buffer"] = buf
        p.add_(d, alpha=-self.lr)

    def export(self, state: OptState) -> Arrays:
        return {name: s["momentum_buffer"].detach().clone(memory_format=torch.contiguous_format)
                for name, s in state.items() if "momentum_buffer" in s}

    def load(self, arrays: Arrays | None, names: Iterable[str]) -> OptState:
        state = self.init_state(names)
        if self.momentum > 0:
            for name in state:
                if arrays and name in arrays:
                    state[name]["momentum_buffer"] = arrays[name].clone()
        return state


class Adam(Optimizer):
    """``torch.optim.Adam`` (single-tensor path, L2 weight decay, no ``maximize``), per parameter."""

    slots = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        self.lr, self.beta1, self.beta2 = float(lr), float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.amsgrad = float(eps), float(weight_decay), bool(amsgrad)

    def update(self, p: torch.Tensor, g: torch.Tensor, s: dict[str, torch.Tensor]) -> None:
        if not s:
            s["step"] = torch.tensor(0.0, dtype=torch.float32)
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.amsgrad:
                s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        s["step"] += 1
        step = s["step"].item()
        step_size, bias_correction2_sqrt = self.corrections(step)
        denom = self.moments(p, g, s["exp_avg"], s["exp_avg_sq"], s.get("max_exp_avg_sq"), bias_correction2_sqrt)
        p.addcdiv_(s["exp_avg"], denom, value=-step_size)

    def corrections(self, step: float) -> tuple[float, float]:
        """``(lr / (1 - beta1^step), sqrt(1 - beta2^step))`` in double, as torch.optim.Adam's scalars."""
        return self.lr / (1 - self.beta1 ** step), (1 - self.beta2 ** step) ** 0.5

    def moments(self, p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: torch.Tensor | None, bias_correction2_sqrt: float | torch.Tensor) -> torch.Tensor:
        """Weight decay, the moments' update in place, and the update's denominator
        ``sqrt(v_hat) + eps`` (of the running maximum with amsgrad). Shared with the vectorized
        engine, which passes client-stacked tensors and a device scalar for the correction."""
        if self.weight_decay != 0:
            g = g.add(p, alpha=self.weight_decay)
        exp_avg.lerp_(g, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        if self.amsgrad:
            assert max_exp_avg_sq is not None
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            return (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        return (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)


def make_optimizer(settings: TrainSettings) -> Optimizer:
    """The kernel ``settings.optimizer`` names, with the settings' hyper-parameters."""
    kind = settings.optimizer
    if kind == "sgd":
        return SGD(settings.lr, settings.momentum, settings.dampening, settings.weight_decay, settings.nesterov)
    if kind == "adam":
        return Adam(settings.lr, settings.betas, settings.eps, settings.weight_decay, settings.amsgrad)
    raise ValueError(f"unknown optimizer {kind!r}; use 'sgd' or 'adam'")
