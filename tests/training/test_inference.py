"""No-grad passes cut into chunks of a few dozen rows per thread on the CPU (fedhet.training.inference)."""

import pytest
import torch

from fedhet.algorithms.fedacd import local_probability_matrix
from fedhet.algorithms.prototypes import class_statistics
from fedhet.core.contract import ClientData
from fedhet.models import build_model
from fedhet.training.inference import ROWS_PER_THREAD, channels_last, pass_rows


@pytest.fixture
def threads():
    """Set torch's intra-op threads for one test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def images(n, classes, seed=0, side=28):
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randint(0, 256, (n, 1, side, side), dtype=torch.uint8, generator=g),
                      torch.randint(0, classes, (n,), generator=g), torch.arange(n),
                      torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.3))


def test_pass_rows_caps_cpu_passes_per_thread_and_leaves_other_devices_the_batch_size(threads):
    threads(2)
    assert pass_rows(2048, "cpu") == 2 * ROWS_PER_THREAD
    assert pass_rows(10, "cpu") == 10                      # the batch size stays the upper bound
    assert pass_rows(2048, torch.device("cuda")) == 2048   # a GPU wants large passes (no CUDA needed to ask)
    assert pass_rows(0, "cpu") == 1


def test_channels_last_restrides_one_channel_images_and_weights():
    # contiguous(memory_format=channels_last) keeps a one-channel tensor's default strides
    # (25, 25, 5, 1), and a convolution then runs in the default layout
    assert channels_last(torch.randn(4, 1, 5, 5)).stride() == (25, 1, 5, 1)
    assert channels_last(torch.randn(2, 3, 4, 4)).stride() == (48, 1, 12, 3)
    assert channels_last(torch.randn(3, 4)).stride() == (4, 1)              # not 4-d: as it is


def test_class_statistics_takes_passes_of_rows_per_thread_and_counts_every_row_once(threads):
    threads(1)
    model = torch.nn.Sequential(torch.nn.Flatten())             # features are the normalised inputs
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(len(args[0])))

    class Split(torch.nn.Module):                                # class_statistics asks for (features, logits)
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x, with_features=False):
            h = self.body(x)
            return (h, h) if with_features else h

    n, classes = 150, 3
    data = images(n, classes, side=2)
    stats = class_statistics(Split(), {}, data, classes)
    assert seen == [64, 64, 22]                                  # not one pass of 150 (batch_size 1024)
    x = data.batch(torch.arange(n)).x.flatten(1).double()
    for c in range(classes):
        rows = data.y == c
        assert int(stats.counts[c]) == int(rows.sum())
        torch.testing.assert_close(stats.means[c], x[rows].mean(0), rtol=1e-12, atol=1e-12)


def test_channels_last_statistics_match_the_default_layout_to_float_rounding(threads):
    threads(1)
    model = build_model("simple_cnn", 1, 10, 28)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = images(200, 10, seed=1)
    P, counts = local_probability_matrix(model, weights, data, 10)
    P_cl, counts_cl = local_probability_matrix(model, weights, data, 10, channels_last=True)
    assert torch.equal(counts, counts_cl)
    # oneDNN rounds the two layouts' convolutions differently (logits ~1e-7 apart); probabilities
    # averaged over ~20 rows of a class stay within float32 rounding of each other
    torch.testing.assert_close(P_cl, P, rtol=0, atol=1e-5)
    torch.testing.assert_close(P.sum(1), (counts > 0).double(), rtol=0, atol=1e-6)   # float32 softmaxes: rows sum to 1
    assert model.training                                        # mode restored
