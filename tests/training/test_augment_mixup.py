"""Mixup (Zhang et al.; FedACD's local training, Zhou et al. Sec. 4.2), ``label_weights`` and
``baseline_augmentation``: hand-computed mixes, the draws' distribution and reproducibility.

(Reproducibility, the partner labels and ``mixed`` are also covered in tests/algorithms/test_fedacd.py.)
"""

from __future__ import annotations

import pytest
import torch

from fedhet.core.contract import Batch
from fedhet.training.augment import Mixup, baseline_augmentation, label_weights


def two_images() -> Batch:
    # two 1x1x2 "images", labels 0 and 2, positions 7 and 3 in the client's split, one earlier extra
    x = torch.tensor([[[[1.0, 2.0]]], [[[10.0, 20.0]]]])
    return Batch(x, torch.tensor([0, 2]), torch.tensor([7, 3]), {"tag": "kept"})


def test_mixup_of_two_known_images_with_a_known_lambda_hand_computed():
    b = two_images()
    lam = torch.tensor([0.25, 0.75], dtype=torch.float64)
    out = Mixup(1.0).apply(b, {"perm": torch.tensor([1, 0]), "lam": lam})
    # x~_0 = 0.25 x_0 + 0.75 x_1 ; x~_1 = 0.25 x_1 + 0.75 x_0
    expected = torch.tensor([[[[7.75, 15.5]]], [[[3.25, 6.5]]]])
    assert out.x.dtype == torch.float32
    torch.testing.assert_close(out.x, expected, rtol=0, atol=0)
    # labels and the samples' positions in the split are those of the own images, unchanged
    assert torch.equal(out.y, torch.tensor([0, 2]))
    assert torch.equal(out.index, torch.tensor([7, 3]))
    # the partner labels and (lam, 1 - lam) are recorded; earlier extras survive
    assert torch.equal(out.extras["mix_y"], torch.tensor([2, 0]))
    assert torch.equal(out.extras["mix_lam"], lam) and out.extras["mix_lam"].dtype == torch.float64
    assert out.extras["tag"] == "kept"
    # each mixed sample is 0.25 of its own class and 0.75 of its partner's
    torch.testing.assert_close(label_weights(out, 3),
                               torch.tensor([[0.25, 0.0, 0.75], [0.75, 0.0, 0.25]], dtype=torch.float64))


def test_mixup_call_keeps_the_sample_positions_of_the_batch():
    b = Batch(torch.arange(8.0).view(4, 1, 1, 2), torch.tensor([0, 1, 2, 3]), torch.tensor([11, 5, 2, 9]))
    out = Mixup(0.5)(b, torch.Generator().manual_seed(0))
    assert torch.equal(out.index, torch.tensor([11, 5, 2, 9]))


def test_label_weights_of_an_unmixed_batch_are_one_hot():
    b = Batch(torch.zeros(3, 1), torch.tensor([2, 0, 2]), torch.arange(3))
    w = label_weights(b, 4)
    assert w.dtype == torch.float64
    assert torch.equal(w, torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 1, 0]], dtype=torch.float64))


def test_label_weights_are_made_on_the_labels_device():
    # "meta" stands in for an accelerator: every tensor of the result must live where the labels
    # are (a class index tensor left on the host cannot be compared with device labels)
    dev = torch.device("meta")
    plain = Batch(torch.zeros(3, 1, device=dev), torch.zeros(3, dtype=torch.long, device=dev), torch.arange(3))
    w = label_weights(plain, 5)
    assert w.device == dev and w.shape == (3, 5) and w.dtype == torch.float64
    mixed = Batch(plain.x, plain.y, plain.index,
                  {"mix_y": torch.zeros(3, dtype=torch.long, device=dev),
                   "mix_lam": torch.zeros(2, dtype=torch.float64, device=dev)})
    w = label_weights(mixed, 5)
    assert w.device == dev and w.shape == (3, 5)


def test_mixup_lambda_takes_a_continuum_of_values():
    # lam ~ Beta(alpha, alpha) is continuous: 300 independent streams give 300 distinct lambdas
    # (a sampler seeded from a small set of seeds would repeat some)
    lams = [Mixup(1.0).draw(2, torch.Generator().manual_seed(s))["lam"][0].item() for s in range(300)]
    assert len(set(lams)) == 300
    assert all(0.0 < v < 1.0 for v in lams)
    # Beta(1, 1) is uniform on (0, 1): mean 1/2, variance 1/12 (loose bounds for 300 draws)
    mean = sum(lams) / len(lams)
    var = sum((v - mean) ** 2 for v in lams) / len(lams)
    assert abs(mean - 0.5) < 0.06 and abs(var - 1 / 12) < 0.02


def test_mixup_draws_of_a_fixed_stream_are_pinned():
    """Regression pin: the draws of one stream fix every mixup run (FedACD results); a change to how
    ``lam`` is sampled from the stream must show up here. Values from torch's CPU generator and
    numpy's PCG64 Beta sampler; update them only together with a deliberate change of the sampler."""
    d = Mixup(1.0).draw(5, torch.Generator().manual_seed(2024))
    assert d["perm"].tolist() == [2, 3, 1, 0, 4]
    assert d["lam"].dtype == torch.float64
    assert d["lam"].tolist() == pytest.approx([0.679785141851725, 0.320214858148275], abs=1e-12)
    d = Mixup(0.4).draw(5, torch.Generator().manual_seed(2024))
    assert d["lam"].tolist() == pytest.approx([0.8678362597176952, 0.13216374028230482], abs=1e-12)


def test_baseline_augmentation_names_and_the_error_for_an_unknown_one():
    assert baseline_augmentation("none", None) is None
    with pytest.raises(ValueError, match=r"unknown augmentation 'mixup'; expected one of: none, supcon_view"):
        baseline_augmentation("mixup", None)
