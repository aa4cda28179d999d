"""CropFlipRotate (training/augment.py): torchvision's RandomCrop(padding), RandomHorizontalFlip and
RandomRotation of FedFM's CIFAR-100 pipeline, on hand-made 4x4 images whose every pixel is known,
and the ``augment`` parameter that puts it into any FedAvg-family method's local training."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import config

from fedhet.algorithms import algorithm_class
from fedhet.core.contract import Batch
from fedhet.core.errors import ConfigError
from fedhet.training.augment import CropFlipRotate, baseline_augmentation

IMAGE = torch.arange(16.0).view(1, 1, 4, 4)        # pixel (row r, column c) holds 4r + c


def applied(aug: CropFlipRotate, dx: int, dy: int, flip: bool, angle: float, x: torch.Tensor = IMAGE) -> torch.Tensor:
    batch = Batch(x, torch.zeros(1, dtype=torch.long), torch.arange(1), {})
    draws = {"shift": torch.tensor([[dx, dy]]), "flip": torch.tensor([flip]),
             "angle": torch.tensor([angle], dtype=torch.float64)}
    return aug.apply(batch, draws).x[0, 0]


PLAIN = CropFlipRotate(torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1), pad=2)


def test_a_crop_of_the_padded_image_shifts_it_and_fills_black():
    # RandomCrop(4, padding=2) with top-left (i, j) = (2, 3): output[r, c] = image[r + 0, c + 1], 0 past the edge
    right = torch.tensor([[1.0, 2, 3, 0], [5, 6, 7, 0], [9, 10, 11, 0], [13, 14, 15, 0]])
    torch.testing.assert_close(applied(PLAIN, 1, 0, False, 0.0), right, atol=1e-5, rtol=0)
    down = torch.tensor([[4.0, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [0, 0, 0, 0]])
    torch.testing.assert_close(applied(PLAIN, 0, 1, False, 0.0), down, atol=1e-5, rtol=0)
    torch.testing.assert_close(applied(PLAIN, 0, 0, False, 0.0), IMAGE[0, 0], atol=1e-5, rtol=0)


def test_a_flip_mirrors_and_a_quarter_turn_rotates_counter_clockwise():
    torch.testing.assert_close(applied(PLAIN, 0, 0, True, 0.0), IMAGE[0, 0].flip(-1), atol=1e-5, rtol=0)
    # torchvision's positive angle turns the image counter-clockwise: torch.rot90's direction
    torch.testing.assert_close(applied(PLAIN, 0, 0, False, math.pi / 2), torch.rot90(IMAGE[0, 0]), atol=1e-4, rtol=0)
    # crop, then flip, then rotation: the crop's offset is in the image's own axes
    cropped = torch.tensor([[1.0, 2, 3, 0], [5, 6, 7, 0], [9, 10, 11, 0], [13, 14, 15, 0]])
    both = torch.rot90(cropped.flip(-1))
    torch.testing.assert_close(applied(PLAIN, 1, 0, True, math.pi / 2), both, atol=1e-4, rtol=0)


def test_black_is_black_in_pixel_values_whatever_the_normalisation():
    mean, std = torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.25)
    aug = CropFlipRotate(mean, std, pad=2)
    normalised = (IMAGE / 16 - mean) / std
    out = applied(aug, 2, 0, False, 0.0, normalised)
    torch.testing.assert_close(out[:, 2:], torch.full((4, 2), -2.0), atol=1e-5, rtol=0)       # (0 - 0.5) / 0.25
    torch.testing.assert_close(out[:, :2], normalised[0, 0, :, 2:], atol=1e-5, rtol=0)


def test_draws_stay_in_their_ranges_and_repeat_for_a_stream():
    aug = CropFlipRotate(torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))           # pad 4, 15 degrees
    a = aug.draw(5000, torch.Generator().manual_seed(3))
    b = aug.draw(5000, torch.Generator().manual_seed(3))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(a["shift"].unique().tolist()) == set(range(-4, 5))
    assert a["angle"].abs().max() <= math.radians(15) and a["angle"].abs().max() > math.radians(14.9)
    assert 0.45 < a["flip"].float().mean() < 0.55
    with pytest.raises(ValueError, match="square images only"):
        applied(PLAIN, 0, 0, False, 0.0, torch.zeros(1, 1, 4, 5))


def test_the_augment_parameter_reaches_local_training_and_refuses_mixup_and_per_fedavg(small_config):
    from fedhet.experiment.build import make_algorithm

    cfg = config(small_config, "fedprox", {"augment": "crop_flip_rotate", "mu": 0.1})
    algorithm = make_algorithm(cfg)
    data = type("Data", (), {"mean": torch.zeros(1, 1, 1, 1), "std": torch.ones(1, 1, 1, 1)})()
    client = type("Client", (), {"data": data})()
    assert isinstance(algorithm.train_options(None, None, client)["augment"], CropFlipRotate)
    assert isinstance(baseline_augmentation("crop_flip_rotate", data), CropFlipRotate)
    fedavg = algorithm_class("fedavg")
    with pytest.raises(ConfigError, match="mixup and augment crop_flip_rotate each take a local batch's one"):
        fedavg(fedavg.Params(mixup=True, augment="crop_flip_rotate"))
    perfedavg = algorithm_class("perfedavg")
    with pytest.raises(ConfigError, match="perfedavg's local steps take no augmentation"):
        perfedavg(perfedavg.Params(augment="crop_flip_rotate"))
