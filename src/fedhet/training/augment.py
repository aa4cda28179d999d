"""Batch augmentations for ``train_local(augment=...)`` and the losses that read what they add.

An augmentation is a callable ``(batch, generator) -> batch`` that draws from the per-epoch
stream it is given, so it is reproducible per (seed, round, client, epoch) like the batch order.
The two below are :class:`Augmentation` s: a call is ``apply(batch, draw(len(batch.y), generator))``,
where ``draw`` makes every random draw of one batch on the host (tensors) and ``apply`` is tensor
arithmetic alone. The vectorized engine draws a whole schedule's worth first, in the reference's
order from the same streams, and applies them under ``vmap`` on the device, so an augmented run
does not depend on the engine (to float tolerance).

* :class:`Mixup` (Zhang et al., ICLR 2018; FedACD's local training, Zhou et al. Sec. 4.2):
  ``x~ = lam x + (1 - lam) x[perm]`` with ``lam ~ Beta(alpha, alpha)`` once per batch and
  ``perm`` a random permutation of the batch. It records the partner labels and ``lam`` in
  ``batch.extras`` (``"mix_y"``, ``"mix_lam"``); a loss term takes them into account with
  :func:`mixed` (``lam L(y) + (1 - lam) L(y[perm])``) or :func:`label_weights`.
* :class:`SupConViews` (FedClassAvg): two augmented views of every image, stacked in one batch.
* :class:`CropFlipRotate`: random crop of a padded image, horizontal flip and rotation, the CIFAR
  pipeline of FedFM's code for CIFAR-100 (``RandomCrop(32, padding=4)``, ``RandomHorizontalFlip``,
  ``RandomRotation(15)``).

A method built on FedAvg trains on one of the last two (:func:`baseline_augmentation`, its
``augment`` parameter: ``supcon_view``, one view of FedClassAvg's pipeline, so that an ablation
table compares objectives, not data pipelines; ``crop_flip_rotate``) instead of the clean image.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedhet.core.contract import Batch, ClientData

# What a method's ``augment`` parameter may name (see baseline_augmentation).
BaselineAugmentation = Literal["none", "supcon_view", "crop_flip_rotate"]


class Augmentation:
    """An augmentation in two parts (module docstring): ``draw`` (host, from the stream) and
    ``apply`` (pure tensor arithmetic, vmappable); ``signature`` says which instances the
    vectorized engine may apply together (the same arithmetic with the same constants)."""

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def apply(self, batch: Batch, draws: dict[str, torch.Tensor]) -> Batch:
        raise NotImplementedError

    def signature(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def rows(self, n: int) -> int:
        """How many inputs ``apply`` makes of a batch of ``n`` (what the model's forward pass sees): the
        vectorized engine draws the batch's dropout masks for that many rows before applying it, so an
        augmentation that changes the number of rows must override this. ``apply`` keeps the images' shape."""
        return n

    def to(self, device: torch.device | str) -> Augmentation:
        """This augmentation with its tensor constants on ``device`` (itself when it has none or
        they are there already), so that ``apply`` copies nothing from the host."""
        return self

    def __call__(self, batch: Batch, generator: torch.Generator) -> Batch:
        draws = self.draw(len(batch.y), generator)
        return self.apply(batch, {k: v.to(batch.x.device) for k, v in draws.items()})


@dataclass(frozen=True)
class Mixup(Augmentation):
    """Input mixup with one ``lam ~ Beta(alpha, alpha)`` per batch. ``batch.extras["mix_lam"]`` is
    ``(lam, 1 - lam)``, computed in double (a float64 tensor of 2)."""

    alpha: float = 1.0

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise ValueError(f"mixup alpha must be positive, got {self.alpha}")

    def signature(self) -> tuple[Any, ...]:
        return ("mixup", self.alpha)

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        perm = torch.randperm(n, generator=generator)
        # torch's Beta sampler takes no generator: a numpy Beta seeded from the stream keeps it reproducible.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        lam = float(np.random.default_rng(seed).beta(self.alpha, self.alpha))
        return {"perm": perm, "lam": torch.tensor([lam, 1.0 - lam], dtype=torch.float64)}

    def apply(self, batch: Batch, draws: dict[str, torch.Tensor]) -> Batch:
        perm, lam = draws["perm"], draws["lam"]
        weight = lam.to(batch.x.dtype)      # each rounded once, like a Python float times the tensor
        x = weight[0] * batch.x + weight[1] * batch.x[perm]
        return Batch(x, batch.y, batch.index, {**batch.extras, "mix_y": batch.y[perm], "mix_lam": lam})


def mixed(loss_of_labels: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> torch.Tensor:
    """``loss_of_labels(y)`` on an ordinary batch; ``lam L(y) + (1 - lam) L(y_partner)`` on a mixed one."""
    partner = batch.extras.get("mix_y")
    if partner is None:
        return loss_of_labels(batch.y)
    lam: torch.Tensor = batch.extras["mix_lam"]
    own, other = loss_of_labels(batch.y), loss_of_labels(partner)
    return lam[0].to(own.dtype) * own + lam[1].to(other.dtype) * other


def mixed_cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean ``CE(logits, y)``; on a mixed batch ``lam CE(y) + (1 - lam) CE(y_partner)``."""
    return mixed(lambda y: F.cross_entropy(logits, y), batch)


def label_weights(batch: Batch, num_classes: int) -> torch.Tensor:
    """(B, C) weight of each sample on each class: one-hot labels, or ``lam onehot(y) + (1 - lam)
    onehot(y_partner)`` on a mixed batch (how much of each class a mixed sample is)."""
    classes = torch.arange(num_classes, device=batch.y.device)
    weights = (batch.y.unsqueeze(1) == classes).double()
    partner: torch.Tensor | None = batch.extras.get("mix_y")
    if partner is None:
        return weights
    lam: torch.Tensor = batch.extras["mix_lam"]
    return lam[0] * weights + lam[1] * (partner.unsqueeze(1) == classes).double()


@dataclass(frozen=True)
class SupConViews(Augmentation):
    """Two augmented views of every image, stacked: ``x = [view 1; view 2]`` (2B rows) and
    ``y = [y; y]``, with ``batch.extras["views"] = 2`` (``views=1``: one view, B rows) (FedClassAvg's
    local training, Jang et al. Sec. 4.1; the pipeline of the authors' ``supcon_utils.load_dataset``): random resized crop
    (area ``scale``, aspect ``ratio``), horizontal flip (p 0.5), colour jitter (brightness,
    contrast, saturation, hue; p 0.8) and random grayscale (p 0.2), on the whole batch at once.

    Images are un-normalised with ``mean``/``std`` to [0, 1], transformed, clamped and normalised
    again. Differences from torchvision's PIL transforms, for batched tensors: a crop whose sides
    would exceed the image is shrunk to fit (torchvision retries 10 draws, then falls back to a
    centre crop); resampling is bilinear through ``grid_sample`` (border padding); the jitter
    factors apply in a fixed order (brightness, contrast, saturation, hue), hue as a rotation of
    the chroma plane in YIQ space; saturation, hue and grayscale do nothing to 1-channel images.
    The sampling grid is torch's ``affine_grid`` (``align_corners=False``) written out, which vmap
    batches (``affine_grid`` has no batching rule).
    """

    mean: torch.Tensor
    std: torch.Tensor
    scale: tuple[float, float] = (0.2, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)
    jitter_p: float = 0.8
    grayscale_p: float = 0.2
    views: int = 2          # 1: one augmented view of each image (baselines trained like FedClassAvg)

    def __post_init__(self) -> None:
        if self.views < 1:
            raise ValueError(f"SupConViews needs at least one view, got views={self.views}")

    def signature(self) -> tuple[Any, ...]:
        # mean / std by identity: the clients of a run share the pool's normalisation tensors
        return ("supcon_views", id(self.mean), id(self.std), self.scale, self.ratio, self.flip_p, self.jitter,
                self.jitter_p, self.grayscale_p, self.views)

    def to(self, device: torch.device | str) -> SupConViews:
        mean, std = self.mean.to(device), self.std.to(device)
        return self if mean is self.mean and std is self.std else replace(self, mean=mean, std=std)

    def rows(self, n: int) -> int:
        return n * self.views

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Per view, in this order: the crop boxes, the flips, the colour draws."""
        boxes, flips, colours = [], [], []
        for _ in range(self.views):
            boxes.append(self.crop_boxes(n, generator))
            flips.append(torch.rand(n, generator=generator) < self.flip_p)
            colours.append(torch.rand(n, 6, generator=generator))
        return {"box": torch.stack(boxes), "flip": torch.stack(flips), "colour": torch.stack(colours)}

    def apply(self, batch: Batch, draws: dict[str, torch.Tensor]) -> Batch:
        mean, std = self.mean.to(batch.x.device), self.std.to(batch.x.device)
        images = batch.x * std + mean
        views = [((self.view(images, draws["box"][v], draws["flip"][v], draws["colour"][v]) - mean) / std)
                 for v in range(self.views)]
        return Batch(torch.cat(views), batch.y.repeat(self.views), batch.index, {**batch.extras, "views": self.views})

    def crop_boxes(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n, 4): width, height (fractions of the side), centre x, centre y (in [0, 1])."""
        u = torch.rand(n, 4, generator=generator, dtype=torch.float64)
        area = self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 0]
        log_lo, log_hi = torch.log(torch.tensor(self.ratio, dtype=torch.float64))
        aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, 1])
        w = torch.sqrt(area * aspect).clamp(max=1.0)
        h = torch.sqrt(area / aspect).clamp(max=1.0)
        cx = w / 2 + (1 - w) * u[:, 2]
        cy = h / 2 + (1 - h) * u[:, 3]
        return torch.stack([w, h, cx, cy], 1)

    def view(self, images: torch.Tensor, box: torch.Tensor, flip: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
        box = box.to(images.dtype)
        sx = torch.where(flip, -box[:, 0], box[:, 0])
        zero = torch.zeros_like(sx)
        theta = torch.stack([torch.stack([sx, zero, 2 * box[:, 2] - 1], 1),
                             torch.stack([zero, box[:, 1], 2 * box[:, 3] - 1], 1)], 1)      # (n, 2, 3)
        grid = _affine_grid(theta, images.shape[-2], images.shape[-1])
        out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return self.colour(out, colour).clamp(0.0, 1.0)

    def colour(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Colour jitter and grayscale with the draws ``u`` (n, 6): jitter on, its four factors, grayscale."""
        n, c = x.shape[:2]
        b, ct, s, h = self.jitter
        u = u.to(x.dtype)
        on = (u[:, 0] < self.jitter_p).view(n, 1, 1, 1)

        def factor(col: torch.Tensor, amount: float) -> torch.Tensor:
            return (1 - amount + 2 * amount * col).view(n, 1, 1, 1)

        def gray(t: torch.Tensor) -> torch.Tensor:
            if t.shape[1] == 1:
                return t
            return _mix(t, (_TO_YIQ[0],))

        j = (x * factor(u[:, 1], b)).clamp(0, 1)
        mean_gray = gray(j).mean(dim=(1, 2, 3), keepdim=True)
        j = ((j - mean_gray) * factor(u[:, 2], ct) + mean_gray).clamp(0, 1)
        if c == 3:
            j = ((j - gray(j)) * factor(u[:, 3], s) + gray(j)).clamp(0, 1)
            angle = (2 * u[:, 4] - 1) * h * 2 * math.pi
            j = _rotate_hue(j, angle).clamp(0, 1)
        x = torch.where(on, j, x)
        if c == 3:
            to_gray = (u[:, 5] < self.grayscale_p).view(n, 1, 1, 1)
            x = torch.where(to_gray, gray(x).expand_as(x), x)
        return x


@dataclass(frozen=True)
class CropFlipRotate(Augmentation):
    """Per image: a crop of the image padded by ``pad`` pixels of black on every side, the same size
    as the image (torchvision's ``RandomCrop(size, padding=pad)``: an offset of -pad..pad pixels on
    each axis), a horizontal flip with probability ``flip_p`` and a rotation by an angle uniform in
    [-``degrees``, ``degrees``] about the centre, the corners filled with black. The three compose
    into one affine map, sampled once, on the images un-normalised with ``mean``/``std`` (so that
    black is 0, torchvision's fill) and normalised again. Where torchvision's ``RandomRotation``
    takes the nearest pixel, this interpolates bilinearly (the crop and the flip move whole pixels:
    exact either way). Square images only (the rotation is written in the grid's [-1, 1] units)."""

    mean: torch.Tensor
    std: torch.Tensor
    pad: int = 4
    flip_p: float = 0.5
    degrees: float = 15.0

    def __post_init__(self) -> None:
        if self.pad < 0 or not 0 <= self.flip_p <= 1 or self.degrees < 0:
            raise ValueError(f"CropFlipRotate needs pad >= 0, 0 <= flip_p <= 1 and degrees >= 0; got pad={self.pad}, "
                             f"flip_p={self.flip_p}, degrees={self.degrees}")

    def signature(self) -> tuple[Any, ...]:
        return ("crop_flip_rotate", id(self.mean), id(self.std), self.pad, self.flip_p, self.degrees)

    def to(self, device: torch.device | str) -> CropFlipRotate:
        mean, std = self.mean.to(device), self.std.to(device)
        return self if mean is self.mean and std is self.std else replace(self, mean=mean, std=std)

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The offsets (dx, dy) in pixels, the flips, the angles in radians."""
        shift = torch.randint(-self.pad, self.pad + 1, (n, 2), generator=generator)
        flip = torch.rand(n, generator=generator) < self.flip_p
        angle = (2 * torch.rand(n, generator=generator, dtype=torch.float64) - 1) * math.radians(self.degrees)
        return {"shift": shift, "flip": flip, "angle": angle}

    def apply(self, batch: Batch, draws: dict[str, torch.Tensor]) -> Batch:
        height, width = batch.x.shape[-2:]
        if height != width:
            raise ValueError(f"crop_flip_rotate rotates square images only, got {height}x{width}")
        mean, std = self.mean.to(batch.x.device), self.std.to(batch.x.device)
        images = batch.x * std + mean
        angle = draws["angle"].to(images.dtype)
        cos, sin = torch.cos(angle), torch.sin(angle)
        mirror = torch.where(draws["flip"], -torch.ones_like(cos), torch.ones_like(cos))
        # output pixel q reads input F R q + t: rotated, then mirrored, then cropped (as composed by
        # torchvision in the other order on images); t: the offset in the grid's units (2 / side a pixel)
        t = draws["shift"].to(images.dtype) * (2.0 / width)
        theta = torch.stack([torch.stack([mirror * cos, -mirror * sin, t[:, 0]], 1),
                             torch.stack([sin, cos, t[:, 1]], 1)], 1)                 # (n, 2, 3)
        grid = _affine_grid(theta, height, width)
        out = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        return Batch((out - mean) / std, batch.y, batch.index, batch.extras)


def baseline_augmentation(name: BaselineAugmentation, data: ClientData) -> Augmentation | None:
    """The augmentation a method's ``augment`` parameter names: ``none`` (clean images),
    ``supcon_view`` (one view of FedClassAvg's pipeline per image, :class:`SupConViews` with
    ``views=1``; cross-entropy then sees the same kind of images as FedClassAvg's first view) or
    ``crop_flip_rotate`` (:class:`CropFlipRotate` with its defaults, FedFM's CIFAR-100 pipeline)."""
    if name == "none":
        return None
    if name == "supcon_view":
        return SupConViews(data.mean, data.std, views=1)
    if name == "crop_flip_rotate":
        return CropFlipRotate(data.mean, data.std)
    raise ValueError(f"unknown augmentation {name!r}; expected one of: none, supcon_view, crop_flip_rotate")


def _affine_grid(theta: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``F.affine_grid(theta, (n, c, height, width), align_corners=False)``: the pixel centres in
    [-1, 1] coordinates, (x, y, 1) each, times ``theta`` (n, 2, 3) transposed; (n, height, width, 2).
    The centres are computed as ATen computes them; the product may sum in another order."""
    def centres(k: int) -> torch.Tensor:
        if k <= 1:
            return torch.zeros(k, dtype=theta.dtype, device=theta.device)
        return torch.linspace(-1, 1, k, dtype=theta.dtype, device=theta.device) * (k - 1) / k

    xs, ys = centres(width), centres(height)
    base = torch.stack([xs.view(1, width).expand(height, width), ys.view(height, 1).expand(height, width),
                        torch.ones(height, width, dtype=theta.dtype, device=theta.device)], -1)
    return (base.view(1, height * width, 3) @ theta.transpose(1, 2)).view(-1, height, width, 2)


# RGB -> YIQ and back, as Python floats: no tensor is made from host data inside a step, which a
# CUDA graph capture would refuse (the vectorized engine applies augmentations inside one).
_TO_YIQ = ((0.299, 0.587, 0.114), (0.596, -0.274, -0.322), (0.211, -0.523, 0.312))
_FROM_YIQ = tuple(tuple(float(v) for v in row) for row in np.linalg.inv(np.array(_TO_YIQ)))


def _mix(t: torch.Tensor, rows: tuple[tuple[float, ...], ...]) -> torch.Tensor:
    """Per pixel, output channel i = sum_j rows[i][j] * input channel j (3 input channels)."""
    return torch.stack([r[0] * t[:, 0] + r[1] * t[:, 1] + r[2] * t[:, 2] for r in rows], 1)


def _rotate_hue(rgb: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate the chroma (I, Q) of YIQ by ``angle`` radians per image (a hue shift)."""
    yiq = _mix(rgb, _TO_YIQ)
    cos, sin = torch.cos(angle).view(-1, 1, 1), torch.sin(angle).view(-1, 1, 1)
    i, q = yiq[:, 1], yiq[:, 2]
    yiq = torch.stack([yiq[:, 0], cos * i - sin * q, sin * i + cos * q], 1)
    return _mix(yiq, _FROM_YIQ)
