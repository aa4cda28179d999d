"""A model of your own: a builder that returns a fedhet SplitModel (named stages; the head starts
at ``split``), so that every method knows its body (the feature extractor) and its head.

    fedhet run CONFIG --set model.arch=nets:small_mlp --set model.split=out --set 'model.options={hidden: 64}'
"""

from __future__ import annotations

from torch import nn

from fedhet.extend import SplitModel


def small_mlp(in_channels: int, num_classes: int, image_size: int, split: str = "out", hidden: int = 128) -> SplitModel:
    stages = [
        ("flat", nn.Flatten()),
        ("fc", nn.Sequential(nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU())),
        ("out", nn.Linear(hidden, num_classes)),
    ]
    return SplitModel(stages, split, (in_channels, image_size, image_size))
