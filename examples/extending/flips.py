"""An augmentation of your own: random horizontal flips, which every engine applies as it applies
the built-in ones (the vectorized engine batches the clients' flips under vmap, with no fallback).

An :class:`Augmentation` comes in two parts: ``draw`` makes every random choice of one batch from
the stream it is given (so a run is reproducible per seed, round, client and epoch), and ``apply``
is tensor arithmetic on the batch alone. ``signature`` says which instances may be applied together.

    PYTHONPATH=examples/extending fedhet run configs/quickstart.yaml --set algorithm.name=flips:FedFlip \
        --set name=fedflip --set algorithm.params.flip_p=0.5
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from fedhet.extend import Augmentation, Batch, FedAvg


@dataclass(frozen=True)
class RandomFlip(Augmentation):
    p: float = 0.5               # chance that an image is mirrored left to right

    def signature(self) -> tuple:
        return ("random_flip", self.p)

    def draw(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"flip": torch.rand(n, generator=generator) < self.p}

    def apply(self, batch: Batch, draws: dict[str, torch.Tensor]) -> Batch:
        mirrored = torch.where(draws["flip"].view(-1, 1, 1, 1), batch.x.flip(-1), batch.x)
        return Batch(mirrored, batch.y, batch.index, batch.extras)


class FedFlip(FedAvg):
    """FedAvg whose clients train on randomly mirrored images."""

    name = "fedflip"
    takes_mixup = False          # the flips take the augmentation slot mixup would use: mixup is refused,
    takes_augment = False        # and so is another augmentation (algorithm.params.augment)

    class Params(FedAvg.Params):
        flip_p: float = Field(0.5, ge=0, le=1)

    def train_options(self, msg, state, client):
        return {**super().train_options(msg, state, client), "augment": RandomFlip(self.params.flip_p)}
