"""SupConViews.colour (FedClassAvg's colour jitter and grayscale, the SupCon recipe) step by step,
against hand-computed values: contrast about each image's own gray mean, saturation as a blend
with the luminance, hue as a rotation of YIQ's chroma plane (by pi: every pixel reflected
through its gray, ``2 Y - rgb``), each factor's range and draw column, and the clamp to [0, 1]
after every step (torchvision's ``adjust_*`` clamp each result)."""

import math

import pytest
import torch

from fedhet.training.augment import SupConViews


def views(channels=3, **kwargs):
    """Identity normalisation (mean 0, std 1), so that colour sees the pixels as given."""
    return SupConViews(torch.zeros(1, channels, 1, 1), torch.ones(1, channels, 1, 1), **kwargs)


def u_colour(on=0.0, b=0.5, ct=0.5, s=0.5, h=0.5, gray=0.99, n=1):
    """The six colour draws of ``n`` images: jitter on, its four factors, grayscale."""
    return torch.tensor([[on, b, ct, s, h, gray]] * n)


def pixels(*rgb):
    """One 3-channel image (1, 3, 1, k) from k (r, g, b) pixels."""
    return torch.tensor(rgb, dtype=torch.float32).T.reshape(1, 3, 1, len(rgb))


def luminance(rgb):
    return 0.299 * rgb[:, 0:1] + 0.587 * rgb[:, 1:2] + 0.114 * rgb[:, 2:3]


# --- contrast ------------------------------------------------------------------------------------


def test_contrast_blends_with_each_images_own_gray_mean():
    """Contrast 0.5 (amount 0.5, draw 0): every pixel halfway to the mean of its own image.
    One-channel images with means 0.3 and 0.9: [0.2, 0.4] -> [0.25, 0.35], [0.8, 1.0] -> [0.85, 0.95]
    (the batch's mean, 0.6, would give other values)."""
    aug = views(1, jitter=(0.0, 0.5, 0.0, 0.0))
    x = torch.tensor([[[[0.2, 0.4]]], [[[0.8, 1.0]]]])
    out = aug.colour(x, u_colour(ct=0.0, n=2))
    torch.testing.assert_close(out, torch.tensor([[[[0.25, 0.35]]], [[[0.85, 0.95]]]]))


def test_contrast_of_a_colour_image_uses_the_mean_luminance_not_per_channel_means():
    """Pixels red and blue: luminances 0.299 and 0.114, mean 0.2065; contrast 0.5 moves every
    channel halfway to 0.2065 (1 -> 0.60325, 0 -> 0.10325). A second, uniform gray image (0.8)
    is a fixed point of contrast, and must not change the first one's mean."""
    aug = views(jitter=(0.0, 0.5, 0.0, 0.0))
    x = torch.cat([pixels((1.0, 0.0, 0.0), (0.0, 0.0, 1.0)), torch.full((1, 3, 1, 2), 0.8)])
    out = aug.colour(x, u_colour(ct=0.0, n=2))
    hi, lo = 0.2065 + 0.5 * (1 - 0.2065), 0.2065 * 0.5
    expected = torch.tensor([[[[hi, lo]], [[lo, lo]], [[lo, hi]]]])
    torch.testing.assert_close(out[:1], expected)
    torch.testing.assert_close(out[1:], torch.full((1, 3, 1, 2), 0.8))


def test_contrast_result_is_clamped_to_the_unit_interval():
    """Contrast 0.9 with draw 1: factor 1.9 about the mean 0.5: 0.1 -> -0.26 -> 0, 0.9 -> 1.26 -> 1.
    A one-channel image: nothing after contrast would clamp it again inside ``colour``."""
    aug = views(1, jitter=(0.0, 0.9, 0.0, 0.0))
    x = torch.tensor([[[[0.1, 0.9, 0.5, 0.5]]]])
    out = aug.colour(x, u_colour(ct=1.0))
    torch.testing.assert_close(out, torch.tensor([[[[0.0, 1.0, 0.5, 0.5]]]]))


# --- saturation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("u_s", "factor"), [(0.0, 0.5), (0.25, 0.75), (1.0, 1.5)])
def test_saturation_blends_with_the_luminance_by_a_factor_uniform_in_one_plus_or_minus_the_amount(u_s, factor):
    """Saturation 0.5: factor 0.5 + u_s; the pixel (0.6, 0.4, 0.2), luminance 0.437, becomes
    0.437 + factor * (rgb - 0.437). The hue amount is 0 (angle 0 whatever its draw, 0.9 here:
    the hue draw must not act as the saturation draw)."""
    aug = views(jitter=(0.0, 0.0, 0.5, 0.0))
    x = pixels((0.6, 0.4, 0.2))
    out = aug.colour(x, u_colour(s=u_s, h=0.9))
    y = 0.299 * 0.6 + 0.587 * 0.4 + 0.114 * 0.2
    expected = pixels(*[tuple(y + factor * (v - y) for v in (0.6, 0.4, 0.2))])
    torch.testing.assert_close(out, expected)


def test_saturation_zero_gives_the_gray_image():
    """Saturation 1 with draw 0: factor 0, every channel the pixel's luminance."""
    aug = views(jitter=(0.0, 0.0, 1.0, 0.0))
    x = pixels((0.6, 0.4, 0.2), (0.1, 0.9, 0.3))
    out = aug.colour(x, u_colour(s=0.0))
    torch.testing.assert_close(out, luminance(x).expand_as(x))


def test_saturation_is_clamped_before_the_hue_rotation():
    """Red (1, 0, 0), saturation factor 1.9: 1.6309 and -0.2691 clamped back to (1, 0, 0); then the
    hue rotated by pi (amount 0.5, draw 1): 2 Y - rgb with Y = 0.299: (-0.402 -> 0, 0.598, 0.598).
    Unclamped, the rotation would see another luminance and give other values."""
    aug = views(jitter=(0.0, 0.0, 0.9, 0.5))
    out = aug.colour(pixels((1.0, 0.0, 0.0)), u_colour(s=1.0, h=1.0))
    torch.testing.assert_close(out, pixels((0.0, 0.598, 0.598)))


# --- hue -------------------------------------------------------------------------------------------


def test_hue_rotation_by_pi_reflects_every_pixel_through_its_gray_and_is_clamped():
    """Hue 0.5 with draw 1 (angle pi; draw 0: -pi, the same): YIQ's I and Q change sign, Y stays,
    and since the I and Q rows sum to 0 the result is 2 Y - rgb. Red (Y 0.299) -> (-0.402, 0.598,
    0.598), cyan (Y 0.701) -> (1.402, 0.402, 0.402), both clamped; (0.6, 0.4, 0.2) stays inside."""
    aug = views(jitter=(0.0, 0.0, 0.0, 0.5))
    x = pixels((1.0, 0.0, 0.0), (0.0, 1.0, 1.0), (0.6, 0.4, 0.2))
    y = 0.299 * 0.6 + 0.587 * 0.4 + 0.114 * 0.2
    expected = pixels((0.0, 0.598, 0.598), (1.0, 0.402, 0.402), (2 * y - 0.6, 2 * y - 0.4, 2 * y - 0.2))
    for u_h in (1.0, 0.0):
        torch.testing.assert_close(aug.colour(x, u_colour(h=u_h)), expected)


@pytest.mark.parametrize(("amount", "u_h", "angle"), [(0.25, 1.0, math.pi / 2), (0.25, 0.0, -math.pi / 2),
                                                      (0.1, 1.0, 0.2 * math.pi), (0.1, 0.75, 0.1 * math.pi)])
def test_hue_angle_is_uniform_in_plus_or_minus_the_amount_of_a_full_turn(amount, u_h, angle):
    """The angle is (2 u - 1) * amount * 2 pi: it keeps each pixel's luminance and chroma length and
    turns its chroma (I, Q) by |angle| (the sign is the draw's symmetric half, not checked here).
    A pixel whose rotation stays inside [0, 1] (no clamp)."""
    aug = views(jitter=(0.0, 0.0, 0.0, amount))
    x = pixels((0.5, 0.45, 0.4))
    out = aug.colour(x, u_colour(h=u_h)).double()

    def chroma(rgb):
        r, g, b = rgb[0, :, 0, 0].tolist()
        return (0.596 * r - 0.274 * g - 0.322 * b, 0.211 * r - 0.523 * g + 0.312 * b)

    assert float(out.min()) > 0 and float(out.max()) < 1
    torch.testing.assert_close(luminance(out), luminance(x.double()), rtol=0, atol=1e-6)
    (i0, q0), (i1, q1) = chroma(x.double()), chroma(out)
    assert math.hypot(i1, q1) == pytest.approx(math.hypot(i0, q0), rel=1e-4)
    turned = math.atan2(i0 * q1 - q0 * i1, i0 * i1 + q0 * q1)
    assert abs(turned) == pytest.approx(abs(angle), abs=1e-4)


# --- one-channel images ------------------------------------------------------------------------


def test_saturation_hue_and_grayscale_leave_a_one_channel_image_alone():
    """Only brightness and contrast act on one channel: with both factors 1, extreme saturation and
    hue draws and the grayscale draw under its probability give the image back."""
    aug = views(1, jitter=(0.4, 0.4, 1.0, 0.5))
    x = torch.tensor([[[[0.1, 0.7, 0.3]]]])
    torch.testing.assert_close(aug.colour(x, u_colour(s=0.0, h=0.75, gray=0.0)), x)


def test_grayscale_with_probability_p_converts_below_a_draw_of_p_only():
    """Grayscale happens "with probability p": a draw u converts when u < p, so a draw of exactly p
    leaves the colours, a draw just under it gives the luminance in every channel."""
    v = views(grayscale_p=0.25)
    x = pixels((0.9, 0.2, 0.1), (0.1, 0.5, 0.8))
    off = u_colour(on=0.99, gray=0.25)                    # jitter off, grayscale draw = p
    torch.testing.assert_close(v.colour(x, off), x)
    on = u_colour(on=0.99, gray=0.2499)
    torch.testing.assert_close(v.colour(x, on), luminance(x).expand(1, 3, 1, 2))
