"""SupConViews (FedClassAvg's two views, the SupCon recipe): the crop boxes' geometry and their
draws, flips, the view's resampling and clamping, the colour jitter and grayscale computed by hand,
and ``apply``'s un-normalise / normalise round trip."""

import math
import warnings

import pytest
import torch

from fedhet.core.contract import Batch
from fedhet.training.augment import SupConViews


def views(channels=1, **kwargs):
    """Identity normalisation (mean 0, std 1), so that view / colour see the pixels as given."""
    return SupConViews(torch.zeros(1, channels, 1, 1), torch.ones(1, channels, 1, 1), **kwargs)


def u_colour(on=0.0, b=0.5, ct=0.5, s=0.5, h=0.5, gray=0.99, n=1):
    """The six colour draws of ``n`` images: jitter on, its four factors, grayscale."""
    return torch.tensor([[on, b, ct, s, h, gray]] * n)


IDENTITY_BOX = (1.0, 1.0, 0.5, 0.5)


# --- crop boxes ------------------------------------------------------------------------------


def test_crop_boxes_lie_inside_the_image_and_cover_its_whole_extent():
    boxes = views().crop_boxes(4000, torch.Generator().manual_seed(11))
    assert boxes.shape == (4000, 4)
    w, h, cx, cy = boxes.unbind(1)
    assert float(w.min()) > 0 and float(w.max()) <= 1.0
    assert float(h.min()) > 0 and float(h.max()) <= 1.0
    left, right, top, bottom = cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2
    for lo, hi in ((left, right), (top, bottom)):
        assert float(lo.min()) >= -1e-12 and float(hi.max()) <= 1 + 1e-12
        assert float(lo.min()) < 0.01 and float(hi.max()) > 0.99          # every position is reachable
    # a tall box (aspect 3/4 with area near 1 asks for h > 1) is shrunk to the image's height
    assert int((h == 1.0).sum()) > 0


def test_crop_boxes_area_and_aspect_stay_within_the_configured_ranges_and_span_them():
    boxes = views().crop_boxes(4000, torch.Generator().manual_seed(12))
    w, h = boxes[:, 0], boxes[:, 1]
    free = (w < 1) & (h < 1)                     # boxes neither side of which was shrunk to fit
    area, aspect = (w * h)[free], (w / h)[free]
    assert float(area.min()) >= 0.2 - 1e-12 and float(area.max()) <= 1.0 + 1e-12
    assert float(aspect.min()) >= 0.75 * (1 - 1e-12) and float(aspect.max()) <= (4 / 3) * (1 + 1e-12)
    assert float(aspect.min()) < 0.77 and float(aspect.max()) > 1.30
    assert float(area.min()) < 0.22 and float(area.max()) > 0.9


def test_each_box_is_the_random_resized_crop_of_its_four_double_uniforms():
    """torchvision's RandomResizedCrop recipe: the area uniform in ``scale``, the log of the aspect
    uniform in log ``ratio``, the box's position uniform over the room left in each direction,
    from four float64 uniforms per box (area, aspect, x, y) drawn in one (n, 4) block of the stream.
    Ranges small enough that no side is shrunk to fit, so each relation holds exactly."""
    aug = views(scale=(0.1, 0.4), ratio=(0.5, 2.0))
    boxes = aug.crop_boxes(64, torch.Generator().manual_seed(7))
    u = torch.rand(64, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert boxes.dtype == torch.float64
    w, h, cx, cy = boxes.unbind(1)
    assert float(w.max()) < 1 and float(h.max()) < 1
    torch.testing.assert_close(w * h, 0.1 + 0.3 * u[:, 0], rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.log(w / h), math.log(0.5) + (math.log(2.0) - math.log(0.5)) * u[:, 1],
                               rtol=1e-12, atol=1e-13)
    torch.testing.assert_close((cx - w / 2) / (1 - w), u[:, 2], rtol=1e-12, atol=1e-13)     # left edge
    torch.testing.assert_close((cy - h / 2) / (1 - h), u[:, 3], rtol=1e-12, atol=1e-13)     # top edge


def test_crop_boxes_are_reproducible_from_the_generator():
    aug = views()
    a = aug.crop_boxes(32, torch.Generator().manual_seed(5))
    b = aug.crop_boxes(32, torch.Generator().manual_seed(5))
    c = aug.crop_boxes(32, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- flips -------------------------------------------------------------------------------------


def test_a_flip_with_probability_zero_never_mirrors_even_on_a_zero_draw():
    """torch.rand can return exactly 0.0 (24-bit floats): seed 1423's 5082nd float32 draw is one.
    Skipped so that it is the flip draw of one image (after its crop box's four float64 draws),
    flip_p = 0 still does not flip it; flip_p = 1 flips every image."""
    skip = 5081 - 8                  # a float64 draw takes two of the stream's 32-bit words
    g = torch.Generator().manual_seed(1423)
    torch.rand(skip, generator=g)
    views().crop_boxes(1, g)
    assert float(torch.rand(1, generator=g)) == 0.0         # the premise: this draw is exactly zero
    g = torch.Generator().manual_seed(1423)
    torch.rand(skip, generator=g)
    assert not bool(views(flip_p=0.0, views=1).draw(1, g)["flip"].any())
    always = views(flip_p=1.0).draw(200, torch.Generator().manual_seed(0))["flip"]
    assert always.shape == (2, 200) and bool(always.all())


# --- one view: resampling geometry and clamping -------------------------------------------------


# a 2 x 4 image (one channel): rows a b c d
ROWS = torch.tensor([[[[0.0, 0.4, 0.8, 1.0], [1.0, 0.6, 0.2, 0.0]]]])


def one_view(aug, images, box, flip, colour=None):
    n = images.shape[0]
    return aug.view(images, torch.tensor([box] * n, dtype=torch.float64), torch.tensor([flip] * n),
                    u_colour(on=0.99, n=n) if colour is None else colour)


def test_the_whole_image_unflipped_is_the_identity_on_a_non_square_image():
    out = one_view(views(), ROWS, IDENTITY_BOX, False)
    assert out.shape == ROWS.shape
    torch.testing.assert_close(out, ROWS)
    torch.testing.assert_close(one_view(views(), ROWS, IDENTITY_BOX, True), ROWS.flip(-1))


def test_the_left_half_box_is_resampled_bilinearly_and_mirrored_when_flipped():
    """Box: the left half across (w 0.5, centre x 0.25), the full height. Output pixel centres
    (x = -0.75, -0.25, 0.25, 0.75) land at input x = 0.5 x - 0.5, i.e. pixel coordinates -0.25,
    0.25, 0.75, 1.25: border, then bilinear between pixels 0|1, 0|1, 1|2. A row a b c d gives
    a, .75a + .25b, .25a + .75b, .75b + .25c; flipped, the same crop mirrored."""
    box = (0.5, 1.0, 0.25, 0.5)
    expected = torch.tensor([[[[0.0, 0.1, 0.3, 0.5], [1.0, 0.9, 0.7, 0.5]]]])
    torch.testing.assert_close(one_view(views(), ROWS, box, False), expected)
    torch.testing.assert_close(one_view(views(), ROWS, box, True), expected.flip(-1))


def test_a_view_emits_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_view(views(), ROWS, (0.5, 1.0, 0.25, 0.5), True)


def test_a_view_of_out_of_range_pixels_is_clamped_to_the_unit_interval():
    """No jitter, no grayscale: the view of the whole image is the image clamped to [0, 1]."""
    images = torch.tensor([[[[-0.5, 3.0], [1.5, 0.25]]]])
    out = one_view(views(jitter_p=0.0, grayscale_p=0.0), images, IDENTITY_BOX, False)
    torch.testing.assert_close(out, torch.tensor([[[[0.0, 1.0], [1.0, 0.25]]]]))


# --- colour jitter and grayscale -------------------------------------------------------------


def test_colour_with_unit_factors_or_jitter_off_is_the_identity():
    x = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(1))
    aug = views(3)
    # factors 1 (every draw 0.5) and hue angle 0: the jitter is on and changes nothing
    torch.testing.assert_close(aug.colour(x, u_colour(on=0.0, n=2)), x, rtol=0, atol=1e-6)
    # the jitter gate is the first draw (0.9 >= 0.8: off), not the brightness draw (0.1)
    torch.testing.assert_close(aug.colour(x, u_colour(on=0.9, b=0.1, n=2)), x, rtol=0, atol=0)


@pytest.mark.parametrize(("u_b", "expected"), [(0.0, 0.3), (0.25, 0.4), (0.5, 0.5), (1.0, 0.7)])
def test_brightness_factor_is_uniform_in_one_plus_or_minus_the_amount(u_b, expected):
    """Brightness 0.4: the factor runs over [0.6, 1.4] as its draw runs over [0, 1]; a gray 0.5
    image times it. The contrast draw (0.9) has amount 0 here and must not act as brightness."""
    aug = views(jitter=(0.4, 0.0, 0.0, 0.0))
    x = torch.full((1, 1, 2, 3), 0.5)
    out = aug.colour(x, u_colour(b=u_b, ct=0.9))
    torch.testing.assert_close(out, torch.full_like(x, expected))


def test_brightness_clamps_before_the_contrast_mean():
    """Pixels 0.9, 0.1 brightened by 1.4: 1.26 -> 1.0 and 0.14; their mean 0.57; contrast 0.5
    (amount 0.5, draw 0) halves the distances to it: 0.785, 0.355."""
    aug = views(jitter=(0.4, 0.5, 0.0, 0.0))
    x = torch.tensor([[[[0.9, 0.1]]]])
    out = aug.colour(x, u_colour(b=1.0, ct=0.0))
    torch.testing.assert_close(out, torch.tensor([[[[0.785, 0.355]]]]))


def test_out_of_range_pixels_are_clamped_before_the_contrast_mean():
    """Pixels -0.5, 0.5, brightness factor 1: clamped to 0, 0.5 (mean 0.25); contrast 0.5: 0.125, 0.375."""
    aug = views(jitter=(0.0, 0.5, 0.0, 0.0))
    x = torch.tensor([[[[-0.5, 0.5]]]])
    out = aug.colour(x, u_colour(b=0.3, ct=0.0))
    torch.testing.assert_close(out, torch.tensor([[[[0.125, 0.375]]]]))


def test_grayscale_is_the_luminance_with_the_stated_weights():
    """Y = 0.299 R + 0.587 G + 0.114 B in every channel when the grayscale draw is under 0.2."""
    rgb = torch.tensor([[[[1.0, 0.2]], [[0.5, 0.4]], [[0.0, 0.8]]]])          # (1, 3, 1, 2)
    aug = views(3)
    gray = aug.colour(rgb, u_colour(on=0.99, gray=0.0))
    y = torch.tensor([0.299 * 1.0 + 0.587 * 0.5, 0.299 * 0.2 + 0.587 * 0.4 + 0.114 * 0.8])
    torch.testing.assert_close(gray, y.view(1, 1, 1, 2).expand(1, 3, 1, 2))
    torch.testing.assert_close(aug.colour(rgb, u_colour(on=0.99, gray=0.5)), rgb, rtol=0, atol=0)


def test_colour_works_in_the_images_precision():
    """The draws come as float32: a bfloat16 image stays bfloat16, a float64 image is jittered
    in double (brightness 0.4 with draw u: factor 0.6 + 0.8 u, u read exactly)."""
    u = u_colour(b=0.3)
    aug = views(jitter=(0.4, 0.0, 0.0, 0.0))
    assert aug.colour(torch.full((1, 1, 2, 2), 0.5, dtype=torch.bfloat16), u).dtype == torch.bfloat16
    x = torch.full((1, 1, 2, 2), 0.5, dtype=torch.float64)
    out = aug.colour(x, u)
    assert out.dtype == torch.float64
    expected = 0.5 * (0.6 + 0.8 * float(u[0, 1]))
    torch.testing.assert_close(out, torch.full_like(x, expected), rtol=1e-15, atol=0)


# --- apply: un-normalise, transform, normalise ----------------------------------------------------


MEAN = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)
STD = torch.tensor([0.25, 0.2, 0.5]).view(1, 3, 1, 1)


def identity_draws(n, k):
    return {"box": torch.tensor([[IDENTITY_BOX] * n] * k, dtype=torch.float64),
            "flip": torch.zeros(k, n, dtype=torch.bool), "colour": u_colour(on=0.99, n=n).expand(k, n, 6)}


def test_apply_with_identity_draws_gives_back_the_batch_clamped_to_valid_pixels():
    """Identity crops, no jitter, no grayscale: every view is the input, except that a pixel
    outside [0, 1] (1.2 and -0.1 here) comes back as the normalised 1 / 0."""
    pixels = torch.rand(2, 3, 3, 4, generator=torch.Generator().manual_seed(3))
    pixels[0, 0, 0, 0], pixels[1, 2, 1, 1] = 1.2, -0.1
    x = (pixels - MEAN) / STD
    b = Batch(x, torch.tensor([4, 7]), torch.tensor([10, 3]), {"note": "kept"})
    aug = SupConViews(MEAN, STD, jitter_p=0.0, grayscale_p=0.0)
    out = aug.apply(b, identity_draws(2, 2))
    expected = (pixels.clamp(0, 1) - MEAN) / STD
    assert out.x.shape == (4, 3, 3, 4)
    torch.testing.assert_close(out.x, torch.cat([expected, expected]))
    assert float(out.x[0, 0, 0, 0]) == pytest.approx((1 - 0.5) / 0.25)
    assert float(out.x[1, 2, 1, 1]) == pytest.approx((0 - 0.3) / 0.5)
    assert torch.equal(out.y, torch.tensor([4, 7, 4, 7]))
    assert torch.equal(out.index, b.index)
    assert out.extras == {"note": "kept", "views": 2}


def test_apply_moves_the_normalisation_to_the_batchs_device():
    """mean / std stay on the host; a batch on another device (meta: shapes only) is augmented there."""
    aug = SupConViews(MEAN, STD)
    b = Batch(torch.empty(3, 3, 5, 6, device="meta"), torch.zeros(3, dtype=torch.long, device="meta"),
              torch.arange(3, device="meta"))
    out = aug(b, torch.Generator().manual_seed(0))
    assert out.x.device.type == "meta" and out.x.shape == (6, 3, 5, 6)


# --- what the vectorized engine relies on: grouping and the move to the device ----------------


def test_signature_tells_apart_views_with_other_normalisation_tensors():
    """The engine applies one group's constants to every member, so views group only when they
    share the pool's mean and std tensors (by identity) and every setting."""
    mean, std = torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    base = SupConViews(mean, std)
    assert SupConViews(mean, std).signature() == base.signature()
    assert SupConViews(mean.clone(), std).signature() != base.signature()
    assert SupConViews(mean, std.clone()).signature() != base.signature()
    assert SupConViews(mean, std, views=1).signature() != base.signature()


def test_to_the_device_it_is_on_returns_the_same_views():
    aug = views(scale=(0.5, 1.0))
    assert aug.to("cpu") is aug


@pytest.mark.parametrize("moved", ["both", "mean", "std"])
def test_to_another_device_moves_both_constants_and_keeps_the_settings(moved):
    """``meta`` stands in for an accelerator on a CPU-only machine: the constants not there yet
    move, the ones already there stay the same tensors, and every other field is kept."""
    mean = torch.zeros(1, 1, 1, 1, device="meta" if moved == "std" else "cpu")
    std = torch.ones(1, 1, 1, 1, device="meta" if moved == "mean" else "cpu")
    aug = SupConViews(mean, std, scale=(0.5, 1.0), flip_p=0.25, views=1)
    out = aug.to("meta")
    assert out is not aug
    assert out.mean.device.type == "meta" and out.std.device.type == "meta"
    assert (out.mean is mean) == (moved == "std") and (out.std is std) == (moved == "mean")
    assert (out.scale, out.flip_p, out.views) == ((0.5, 1.0), 0.25, 1)
    assert aug.mean is mean and aug.std is std                         # the original is untouched
