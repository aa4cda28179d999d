"""Dropout whose masks come from each client's own random stream.

``torch.nn.Dropout`` draws its masks from torch's global generator: a run with dropout is not
reproducible for a seed (the draws depend on what else used the generator, and in which order the
clients ran), and ``vmap`` refuses the random op, so the vectorized engine could not batch such a
model. :class:`StreamDropout` (a ``nn.Dropout``) takes its masks from a context instead: local
training draws every mask of a batch from the client's per-epoch stream right after the batch's
positions and its augmentation's draws (:func:`draw_masks`), and applies them with
:func:`masks_applied` around the forward pass and the loss. The vectorized engine draws the same
masks from the same streams on the host, with its schedule, and applies them per client under
``vmap``; both engines compute ``x * keep / (1 - p)``, so they agree to float tolerance and a run
is reproducible for a seed.

A method's own training loop or forward pass in training mode (Per-FedAvg's meta-steps, FedRoD's
generic features, SCAFFOLD's full gradient) draws its batches' masks from a stream of the client
too (:func:`batch_masks`) and applies them the same way. With no masks in the context a
``StreamDropout`` is torch's dropout, from the global generator, and says so once per layer (a
warning). Within them, a loss term that runs the model again in training mode (a teacher with other
weights) gets the batch's masks again.
"""

from __future__ import annotations

import contextvars
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedhet.training.mode import in_mode

# Draw names of the masks among a batch's draws (beside the augmentation's own).
MASK_PREFIX = "dropout."

_MASKS: contextvars.ContextVar[dict[str, torch.Tensor] | None] = contextvars.ContextVar("fedhet_dropout_masks",
                                                                                       default=None)


class StreamDropout(nn.Dropout):
    """``nn.Dropout(p)`` whose mask, in fedhet's local training, is the one :func:`draw_masks` drew
    for it from the client's stream (module docstring)."""

    # Its qualified name in the model it belongs to (set by :func:`dropout_layers`).
    mask_key: str = ""
    _warned_unmasked: bool = False

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        masks = _MASKS.get()
        if not self.training or self.p == 0:
            return super().forward(x)
        if masks is None:
            if not self._warned_unmasked:          # once a layer: its draws are torch's global generator's
                self._warned_unmasked = True
                warnings.warn(f"dropout layer {self.mask_key or '(unnamed)'} ran in training mode without masks from "
                              "a client's stream, so its masks come from torch's global generator and the run does "
                              "not repeat for its seed; in a training pass of your own, draw them with "
                              "fedhet.extend.batch_masks and apply them with fedhet.extend.masks_applied",
                              RuntimeWarning, stacklevel=2)
            return super().forward(x)
        keep = masks.get(MASK_PREFIX + self.mask_key)
        if keep is None or keep.shape != x.shape:
            raise RuntimeError(
                f"dropout layer {self.mask_key!r} got {'no mask' if keep is None else f'a mask of shape {tuple(keep.shape)}'} "
                f"for an input of shape {tuple(x.shape)}: the masks were drawn for another model or batch (an "
                f"augmentation that changes the number of rows must say so in Augmentation.rows)")
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))


# model -> {input shape: [(name, p, shape of one sample's mask)]}
_LAYERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], list[tuple[str, float, tuple[int, ...]]]]] = \
    weakref.WeakKeyDictionary()


def dropout_layers(model: nn.Module, sample_shape: tuple[int, ...]) -> list[tuple[str, float, tuple[int, ...]]]:
    """``(name, p, mask shape of one sample)`` of each active :class:`StreamDropout` of ``model`` for
    inputs of ``sample_shape``, in module order; found once per model and shape by a forward pass
    on one zero sample in evaluation mode."""
    per_shape = _LAYERS.get(model)
    if per_shape is None:
        per_shape = _LAYERS[model] = {}
    elif sample_shape in per_shape:          # every batch after the first: one lookup, nothing built
        return per_shape[sample_shape]
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, StreamDropout) and m.p > 0]
    shapes: dict[str, tuple[int, ...]] = {}
    if named:
        for name, m in named:
            m.mask_key = name

        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            assert isinstance(module, StreamDropout)
            shapes[module.mask_key] = tuple(args[0].shape[1:])

        hooks = [m.register_forward_pre_hook(record) for _, m in named]
        param = next(model.parameters(), None)
        try:
            with in_mode(model, training=False), torch.no_grad():
                model(torch.zeros((1, *sample_shape), device=param.device if param is not None else None))
        finally:
            for h in hooks:
                h.remove()
    layers = [(name, float(m.p), shapes[name]) for name, m in named if name in shapes]
    per_shape[sample_shape] = layers
    return layers


def draw_masks(model: nn.Module, sample_shape: tuple[int, ...], rows: int,
               generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The keep masks (bool, ``(rows, *mask shape)``) of every dropout layer of ``model`` for one
    batch of ``rows`` inputs of ``sample_shape``, drawn from ``generator`` in module order; empty for
    a model without :class:`StreamDropout` (nothing is drawn: such runs' streams are unchanged)."""
    masks = {}
    for name, p, shape in dropout_layers(model, sample_shape):
        masks[MASK_PREFIX + name] = torch.rand((rows, *shape), generator=generator) >= p
    return masks


def batch_masks(model: nn.Module, x: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """:func:`draw_masks` for the batch of inputs ``x``, on ``x``'s device: what a training-mode pass
    of a method's own applies with :func:`masks_applied`."""
    return {k: v.to(x.device) for k, v in draw_masks(model, tuple(x.shape[1:]), len(x), generator).items()}


@contextmanager
def masks_applied(masks: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """Within the block, the model's :class:`StreamDropout` layers use ``masks`` (none: a no-op)."""
    if not masks:
        yield
        return
    token = _MASKS.set(masks)
    try:
        yield
    finally:
        _MASKS.reset(token)


def split_draws(draws: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A batch's draws as (the augmentation's, the dropout masks)."""
    masks = {k: v for k, v in draws.items() if k.startswith(MASK_PREFIX)}
    return {k: v for k, v in draws.items() if k not in masks}, masks
