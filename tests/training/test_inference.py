"""Evaluation's no-grad passes on the CPU: chunks of rows per thread in channels_last (fedhet.training.inference)."""

import torch
from helpers import conv_layouts

from fedhet.algorithms.fedacd import local_probability_matrix
from fedhet.algorithms.prototypes import class_statistics
from fedhet.core.contract import ClientData, normalize_uint8
from fedhet.metrics.evaluate import predict
from fedhet.models import build_model
from fedhet.training.inference import ROWS_PER_THREAD, channels_last, pass_rows


def images(n, classes, seed=0, side=28):
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randint(0, 256, (n, 1, side, side), dtype=torch.uint8, generator=g),
                      torch.randint(0, classes, (n,), generator=g), torch.arange(n),
                      torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.3))


def test_pass_rows_caps_cpu_passes_per_thread_and_leaves_other_devices_the_batch_size():
    torch.set_num_threads(2)                               # conftest puts it back to 1
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


class Flat(torch.nn.Module):
    """A model whose features and logits are its flattened inputs; records each pass's rows."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def forward(self, x, with_features=False):
        self.rows.append(len(x))
        h = x.flatten(1)
        return (h, h) if with_features else h


def test_training_statistics_keep_large_passes_and_evaluations_take_rows_per_thread():
    n, classes = 1100, 3
    data = images(n, classes, side=2)
    model = Flat()
    stats = class_statistics(model, {}, data, classes)
    # training's statistics: 1,024 rows a pass, as before (a cut into rows per thread changed the
    # last bits of what training is fed: benchmarks/no_grad_passes.py)
    assert model.rows == [1024, 76]
    model.rows.clear()
    fast = class_statistics(model, {}, data, classes, fast_passes=True)
    assert model.rows == [64] * 17 + [12]
    x = data.batch(torch.arange(n)).x.flatten(1).double()
    for c in range(classes):
        rows = data.y == c
        assert int(stats.counts[c]) == int(rows.sum()) == int(fast.counts[c])
        torch.testing.assert_close(stats.means[c], x[rows].mean(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fast.means[c], x[rows].mean(0), rtol=1e-12, atol=1e-12)


def test_evaluation_passes_run_every_convolution_in_channels_last_and_training_passes_do_not():
    model = build_model("simple_cnn", 1, 10, 28)         # grayscale: one input channel
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = images(200, 10, seed=1)
    layouts = conv_layouts(model)
    P, counts = local_probability_matrix(model, weights, data, 10)
    assert layouts and not any(layouts)                   # FedACD's training statistic: default layout
    layouts.clear()
    P_eval, counts_eval = local_probability_matrix(model, weights, data, 10, fast_passes=True)
    assert layouts and all(layouts)
    assert model.training                                 # the statistics pass restores the mode
    layouts.clear()
    predict(model, weights, data.x, data.y, lambda x: normalize_uint8(x, data.mean, data.std), 2048)
    assert layouts and all(layouts)
    assert torch.equal(counts, counts_eval)
    # oneDNN rounds the two layouts' convolutions differently (logits ~1e-7 apart); probabilities
    # averaged over ~20 rows of a class stay within float32 rounding of each other
    torch.testing.assert_close(P_eval, P, rtol=0, atol=1e-5)
    torch.testing.assert_close(P.sum(1), (counts > 0).double(), rtol=0, atol=1e-6)   # float32 softmaxes: rows sum to 1
