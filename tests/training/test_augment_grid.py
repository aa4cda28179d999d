"""The views' sampling grid (training/augment.py ``_affine_grid``) against torch's own
``F.affine_grid``: the same pixel centres in the theta's precision and on its device, also for
images one pixel high or wide."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedhet.training.augment import _affine_grid


@pytest.mark.parametrize("height,width", [(5, 7), (1, 4), (4, 1), (1, 1)])
def test_affine_grid_is_torchs_in_double(height, width):
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(3, 2, 3, generator=g, dtype=torch.float64)
    got = _affine_grid(theta, height, width)
    want = F.affine_grid(theta, [3, 1, height, width], align_corners=False)
    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("height,width", [(1, 3), (3, 1), (2, 3)])
def test_affine_grid_is_made_on_the_thetas_device(height, width):
    theta = torch.zeros(2, 2, 3, device="meta")
    assert _affine_grid(theta, height, width).device.type == "meta"


@pytest.mark.parametrize("height,width", [(1, 3), (3, 1), (2, 3)])
def test_affine_grid_keeps_a_bfloat16_theta_in_bfloat16(height, width):
    """Every part of the grid is made in theta's dtype: a float32 part would either promote the grid
    or break the product with a bfloat16 theta."""
    theta = torch.tensor([[[1.0, 0.0, 0.25], [0.0, 0.5, 0.0]]], dtype=torch.bfloat16)
    got = _affine_grid(theta, height, width)
    assert got.dtype == torch.bfloat16
    want = F.affine_grid(theta.float(), [1, 1, height, width], align_corners=False)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=1e-2)
