"""Models with an explicit feature-extractor (body) / classifier (head) split.

Every FL method in fedhet sees a model as ``logits = head(features(x))``: FedCME exchanges
heads, FedFM matches features to anchors, FedReMa personalises heads and FedClassAvg averages
heads over different bodies. :class:`SplitModel` puts that split in the module tree, so
parameter names read ``body.<stage>...`` / ``head.<stage>...`` and picking the shared or the
personal part of a state dict is a prefix test.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fedhet.training.mode import in_mode

_UNFLATTEN = "unflatten"
_PARTS = ("body", "head")


class SplitModel(nn.Module):
    """A model built from named stages; the head starts at stage ``split``.

    ``stages`` is an ordered list of ``(name, module)``; the valid split names
    (``split_points``) are every stage name but the first, so body and head are never empty.
    Stages must not use in-place ops, so ``torch.func.functional_call``/``vmap`` work.

    ``forward(x)`` gives logits, ``forward(x, with_features=True)`` gives ``(features,
    logits)``. ``features(x)`` is the body output flattened to ``(B, feature_dim)``;
    ``feature_dim`` is found once at init by a dummy forward of shape ``(1, *input_shape)``
    (recorded as ``input_shape``; the unflattened shape is ``feature_shape``). If the split falls
    before the stage that flattens, the head starts with an ``nn.Unflatten`` (named
    "unflatten", no parameters) so that ``head(features(x)) == forward(x)`` still holds.
    """

    def __init__(
        self,
        stages: Sequence[tuple[str, nn.Module]],
        split: str,
        input_shape: tuple[int, int, int],
    ) -> None:
        super().__init__()
        names = [name for name, _ in stages]
        if len(set(names)) != len(names) or _UNFLATTEN in names:
            raise ValueError(f"stage names must be unique and not {_UNFLATTEN!r}: {names}")
        self.stage_names: tuple[str, ...] = tuple(names)
        self.split_points: tuple[str, ...] = tuple(names[1:])
        if split not in self.split_points:
            raise ValueError(
                f"unknown split {split!r}; valid splits: {', '.join(self.split_points)}"
            )
        self.split = split
        self.input_shape = tuple(input_shape)
        k = names.index(split)
        self.body = nn.Sequential(OrderedDict(stages[:k]))
        self.feature_shape: tuple[int, ...] = self._body_output_shape()
        self.feature_dim: int = math.prod(self.feature_shape)
        head = list(stages[k:])
        if len(self.feature_shape) > 1:
            head.insert(0, (_UNFLATTEN, nn.Unflatten(1, self.feature_shape)))
        self.head = nn.Sequential(OrderedDict(head))

    def add_projection(self, dim: int) -> None:
        """Append a MOON projection stage ``proj`` to the body and rebuild the first head Linear.

        ``proj`` is Linear(d, d) + ReLU + Linear(d, dim) on the flattened features (MOON's
        ModelFedCon ``l1``/``l2``, Li, He & Song 2021), so ``features(x)`` becomes the projection z
        (``feature_dim == dim``) and the head's first Linear is replaced by a freshly initialised
        one taking ``dim`` inputs (same outputs and bias setting). ``head(features(x)) ==
        forward(x)`` still holds. The split must fall after the flatten.
        """
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"projection_dim must be a positive integer, got {dim!r}")
        if "proj" in self.stage_names:
            raise ValueError("the model already has a projection stage")
        if len(self.feature_shape) > 1:
            raise ValueError(f"a projection needs flat features, but split {self.split!r} falls before the "
                             f"flatten (features {self.feature_shape}); split at a Linear stage instead")
        linears = [name for name, m in self.head.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ValueError("a projection needs a Linear in the head to feed")
        d = self.feature_dim
        self.body.add_module("proj", nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, dim)))
        parent_name, _, leaf = linears[0].rpartition(".")
        parent = self.head.get_submodule(parent_name) if parent_name else self.head
        old = getattr(parent, leaf)
        setattr(parent, leaf, nn.Linear(dim, old.out_features, bias=old.bias is not None))
        k = self.stage_names.index(self.split)
        self.stage_names = (*self.stage_names[:k], "proj", *self.stage_names[k:])
        self.feature_shape = (dim,)
        self.feature_dim = dim

    def _body_output_shape(self) -> tuple[int, ...]:
        # eval mode: the dummy forward must not update BatchNorm running statistics
        with in_mode(self.body, training=False), torch.no_grad():
            out = self.body(torch.zeros(1, *self.input_shape))
        return tuple(out.shape[1:])

    def features(self, x: Tensor) -> Tensor:
        """Body output, flattened to ``(B, feature_dim)``."""
        return self.body(x).flatten(1)

    def forward(self, x: Tensor, with_features: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Logits; with ``with_features=True``, ``(features, logits)`` from one pass.

        The keyword exists so that ``functional_call(model, weights, (x,), {"with_features":
        True})`` gets both under the swapped-in weights: functional_call swaps them only for
        the duration of that one call, so a separate ``model.features(x)`` would not see them.
        """
        h = self.features(x)
        logits = self.head(h)
        return (h, logits) if with_features else logits


def param_groups(model: SplitModel) -> dict[str, list[str]]:
    """Parameter names of the body and of the head, in ``named_parameters`` order."""
    names = [name for name, _ in model.named_parameters()]
    return {part: [n for n in names if n.startswith(part + ".")] for part in _PARTS}


def count_params(model: nn.Module, part: str | None = None) -> int:
    """Number of parameter elements in the whole model, or in ``part`` ("body" or "head")."""
    if part is None:
        return sum(p.numel() for p in model.parameters())
    if part not in _PARTS:
        raise ValueError(f"unknown part {part!r}; valid parts: {', '.join(_PARTS)}")
    return sum(p.numel() for p in getattr(model, part).parameters())


def relu_before_pool(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` with each max-pool that a ReLU follows in a Sequential put after it,
    and the number of pairs swapped.

    cnn2 and simple_cnn pool first (``fedhet.models.cnn`` says why); the copy has the order most
    papers write (not FedReMa's AlexNet, whose authors pool first too), the same function, for
    checks and timings against it."""
    paper = copy.deepcopy(model)
    swapped = 0
    for module in paper.modules():
        if not isinstance(module, nn.Sequential):
            continue
        names = [name for name, _ in module.named_children()]
        for first, second in zip(names, names[1:]):
            pool, relu = getattr(module, first), getattr(module, second)
            if isinstance(pool, nn.MaxPool2d) and isinstance(relu, nn.ReLU):
                setattr(module, first, relu)
                setattr(module, second, pool)
                swapped += 1
    return paper, swapped
