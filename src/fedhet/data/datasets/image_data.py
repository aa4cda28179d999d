"""The in-memory form every loader returns (:class:`ImageData`), and how the parsers build it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _INFO


@dataclass(frozen=True, eq=False)  # eq=False: element-wise tensor comparison has no bool value
class ImageData:
    """One split of an image dataset, held as compact tensors.

    Attributes:
        x: ``uint8`` images, shape ``(N, C, H, W)``, contiguous.
        y: ``int64`` labels in ``[0, num_classes)``, shape ``(N,)``.
        num_classes: number of classes of the dataset (not only those present in ``y``).
        mean, std: per-channel normalisation constants for ``x.float() / 255``.
        writers: FEMNIST only: ``int64`` index of the writer (the natural federated client) of
            each sample; ``None`` for the other datasets.
        name: dataset name as in :data:`DATASET_NAMES`.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    writers: np.ndarray | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.x.dtype != torch.uint8 or self.x.dim() != 4:
            raise ValueError(f"ImageData.x must be uint8 (N, C, H, W), got {self.x.dtype} {tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.shape != (self.x.shape[0],):
            raise ValueError(f"ImageData.y must be int64 of shape ({self.x.shape[0]},), got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.mean) != self.x.shape[1] or len(self.std) != self.x.shape[1]:
            raise ValueError("ImageData.mean/std need one value per channel")
        if self.writers is not None and (self.writers.dtype != np.int64 or self.writers.shape != (self.x.shape[0],)):
            raise ValueError("ImageData.writers must be an int64 array with one entry per sample")

    def __len__(self) -> int:
        return int(self.x.shape[0])


def _make(name: str, x: np.ndarray, y: np.ndarray, writers: np.ndarray | None = None) -> ImageData:
    info = _INFO[name]
    if len(y) == 0:
        raise DataError(f"{name}: the split contains no samples")
    return ImageData(
        x=torch.from_numpy(np.ascontiguousarray(x)),
        y=torch.from_numpy(y.astype(np.int64, copy=False)),
        num_classes=info.num_classes,
        mean=info.mean,
        std=info.std,
        writers=writers,
        name=name,
    )


def _check_labels(y: np.ndarray, low: int, high: int, source: object) -> None:
    """Raise unless every label lies in ``[low, high]``."""
    if y.size and (int(y.min()) < low or int(y.max()) > high):
        raise DataError(f"{source}: labels must lie in {low}..{high}, found {int(y.min())}..{int(y.max())}")
