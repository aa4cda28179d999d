"""Tests for fedhet.models: shapes, the body/head split, parameter names and counts, torch.func."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fedhet.models import (
    MODEL_NAMES,
    SplitModel,
    build_model,
    count_params,
    default_split,
    param_groups,
)
from fedhet.models.base import relu_before_pool

SMALL_MODELS = ("cnn2", "simple_cnn", "alexnet_cifar", "alexnet_fedrema", "pfl_cnn")
RESNETS = ("resnet18", "resnet34", "resnet50")
# FedClassAvg's heterogeneous models, tested in test_models_hetero.py
FCA_MODELS = tuple(f"fca_{n}" for n in ("resnet18", "shufflenetv2", "googlenet", "alexnet", "cnn_a", "cnn_b", "cnn_c", "cnn_d",
                                            "tiny_a", "tiny_b", "tiny_c", "tiny_d"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _check_split_model(model: SplitModel, in_channels: int, image_size: int, classes: int) -> None:
    model.eval()
    x = torch.randn(2, in_channels, image_size, image_size)
    logits = model(x)
    assert logits.shape == (2, classes)
    feats = model.features(x)
    assert feats.shape == (2, model.feature_dim)
    assert torch.equal(model.head(feats), logits)
    assert all(n.startswith(("body.", "head.")) for n, _ in model.named_parameters())


def test_registry_lists_all_models() -> None:
    assert set(MODEL_NAMES) == set(SMALL_MODELS + RESNETS + FCA_MODELS)


@pytest.mark.parametrize("name", SMALL_MODELS)
@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("image_size", [28, 32])
def test_small_models_shapes_and_split(name: str, in_channels: int, image_size: int) -> None:
    model = build_model(name, in_channels, 7, image_size)
    assert model.split == default_split(name)
    _check_split_model(model, in_channels, image_size, 7)


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_every_split_point_is_consistent(name: str) -> None:
    for split in build_model(name, 3, 10, 32).split_points:
        _check_split_model(build_model(name, 3, 10, 32, split=split), 3, 32, 10)


@pytest.mark.parametrize("name", RESNETS)
def test_resnet_shapes(name: str) -> None:
    _check_split_model(build_model(name, 3, 10, 32), 3, 32, 10)


def test_resnet18_imagenet_stem_on_1ch_28x28() -> None:
    model = build_model("resnet18", 1, 10, 28, stem="imagenet")
    assert isinstance(model.body.stem.maxpool, nn.MaxPool2d)
    assert model.body.stem.conv.weight.shape == (64, 1, 7, 7)
    _check_split_model(model, 1, 28, 10)


def test_resnet_split_before_pool_uses_flattened_map() -> None:
    model = build_model("resnet18", 3, 10, 32, split="layer4")
    assert model.feature_dim == 256 * 8 * 8  # layer3 output: 32 -> 32 -> 16 -> 8 (cifar stem)
    _check_split_model(model, 3, 32, 10)


def test_resnet_gn_has_no_batchnorm_and_no_buffers() -> None:
    model = build_model("resnet18", 3, 10, 32, norm="gn")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert all(m.num_groups == 2 for m in model.modules() if isinstance(m, nn.GroupNorm))
    assert list(model.buffers()) == []
    gn32 = build_model("resnet18", 3, 10, 32, norm="gn", gn_groups=32)
    assert gn32.body.stem.norm.num_groups == 32
    _check_split_model(model, 3, 32, 10)


def test_build_does_not_touch_batchnorm_stats() -> None:
    model = build_model("resnet18", 3, 10, 32)
    assert model.training
    bn = model.body.stem.norm
    assert int(bn.num_batches_tracked) == 0
    assert torch.equal(bn.running_mean, torch.zeros(64))


# cnn2, 1x28x28 input, 10 classes, counted by hand:
#   conv1 1*32*5*5 + 32     =     832
#   conv2 32*64*5*5 + 64    =  51,264
#   fc1   1024*512 + 512    = 524,800
#   fc2   512*10 + 10       =   5,130
#   total                   = 582,026
CNN2_SHAPES = {
    "body.conv1.0.weight": (32, 1, 5, 5),
    "body.conv1.0.bias": (32,),
    "body.conv2.0.weight": (64, 32, 5, 5),
    "body.conv2.0.bias": (64,),
    "body.fc1.0.weight": (512, 1024),
    "body.fc1.0.bias": (512,),
    "head.fc2.weight": (10, 512),
    "head.fc2.bias": (10,),
}


def test_cnn2_parameter_names_shapes_and_count() -> None:
    model = build_model("cnn2", 1, 10, 28)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == CNN2_SHAPES
    assert model.feature_dim == 512
    assert model.split_points == ("conv2", "fc1", "fc2")
    assert count_params(model) == 582_026
    assert count_params(model, "head") == 5_130
    assert count_params(model, "body") == 582_026 - 5_130
    groups = param_groups(model)
    assert groups["head"] == ["head.fc2.weight", "head.fc2.bias"]
    assert groups["body"] == [n for n in CNN2_SHAPES if n.startswith("body.")]


def test_cnn2_fedrema_split_head_is_both_fcs() -> None:
    model = build_model("cnn2", 1, 10, 28, split="fc1")
    assert model.feature_dim == 1024
    assert param_groups(model)["head"] == [
        "head.fc1.0.weight",
        "head.fc1.0.bias",
        "head.fc2.weight",
        "head.fc2.bias",
    ]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == {n.replace("body.fc1", "head.fc1"): s for n, s in CNN2_SHAPES.items()}
    _check_split_model(model, 1, 28, 10)


def test_cnn2_32x32_computes_flatten_size() -> None:
    assert build_model("cnn2", 3, 10, 32).head.fc2.in_features == 512
    assert build_model("cnn2", 3, 10, 32, split="fc1").feature_dim == 64 * 5 * 5


@pytest.mark.parametrize(
    ("name", "image_size", "feature_dim"),
    [
        ("cnn2", 28, 512),
        ("simple_cnn", 32, 192),
        ("alexnet_cifar", 32, 4096),
        ("alexnet_fedrema", 32, 2304),
        ("resnet18", 32, 512),
        ("resnet50", 32, 2048),
    ],
)
def test_default_feature_dims(name: str, image_size: int, feature_dim: int) -> None:
    assert build_model(name, 3, 10, image_size).feature_dim == feature_dim


def test_flatten_sizes_before_first_fc() -> None:
    assert build_model("simple_cnn", 3, 10, 32, split="fc1").feature_dim == 64 * 5 * 5
    assert build_model("simple_cnn", 1, 10, 28, split="fc1").feature_dim == 64 * 4 * 4
    assert build_model("alexnet_cifar", 3, 10, 32, split="fc1").feature_dim == 256 * 2 * 2


def test_simple_cnn_last_layer_has_no_bias() -> None:
    assert build_model("simple_cnn", 3, 10, 32).head.fc3.bias is None


def test_alexnet_fedrema_head_is_three_linears_without_nonlinearity() -> None:
    head = build_model("alexnet_fedrema", 3, 10, 32).head
    assert list(head.named_children()) == [
        ("fc1", head.fc1),
        ("fc2", head.fc2),
        ("fc3", head.fc3),
    ]
    assert all(isinstance(m, nn.Linear) for m in head.children())


@pytest.mark.parametrize(
    ("name", "in_channels", "image_size", "classes", "expected"),
    [
        # conv 3*64*25+64 + 64*64*25+64, fc 1600*384+384 + 384*192+192, linear 192*10
        ("simple_cnn", 3, 32, 10, 4_864 + 102_464 + 614_784 + 73_920 + 1_920),
        # convs 1,792 + 110,784 + 663,936 + 884,992 + 590,080; fcs 4,198,400 + 16,781,312 + 40,970
        ("alexnet_cifar", 3, 32, 10, 2_251_584 + 21_020_682),
        # convs 896 + 18,496 + 73,856 + 295,168 + 590,080; fcs 2,360,320 + 524,800 + 5,130
        ("alexnet_fedrema", 3, 32, 10, 978_496 + 2_890_250),
        # the CIFAR ResNet-18 (3x3 stem) with a 10-way fc
        ("resnet18", 3, 32, 10, 11_173_962),
    ],
)
def test_known_parameter_counts(
    name: str, in_channels: int, image_size: int, classes: int, expected: int
) -> None:
    assert count_params(build_model(name, in_channels, classes, image_size)) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet50", 25_557_032)],
)
def test_imagenet_resnets_match_torchvision_counts(name: str, expected: int) -> None:
    # published torchvision parameter counts (3 channels, 1000 classes); independent of size
    assert count_params(build_model(name, 3, 1000, 32, stem="imagenet")) == expected


def test_unknown_split_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="fc1, fc2") as err:
        build_model("cnn2", 1, 10, 28, split="nope")
    assert "'nope'" in str(err.value)
    with pytest.raises(ValueError, match="conv2"):
        build_model("cnn2", 1, 10, 28, split="conv1")  # the first stage would leave no body


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="resnet18") as err:
        build_model("vgg11", 3, 10, 32)
    assert all(name in str(err.value) for name in MODEL_NAMES)
    with pytest.raises(ValueError, match="cnn2"):
        default_split("vgg11")


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="image_size >= 16"):
        build_model("cnn2", 1, 10, 12)
    with pytest.raises(ValueError, match="no normalization layers"):
        build_model("cnn2", 1, 10, 28, norm="gn")
    with pytest.raises(ValueError, match="stem"):
        build_model("cnn2", 1, 10, 28, stem="imagenet")
    with pytest.raises(ValueError, match="cifar, imagenet"):
        build_model("resnet18", 3, 10, 32, stem="tiny")
    with pytest.raises(ValueError, match="bn, gn"):
        build_model("resnet18", 3, 10, 32, norm="ln")
    with pytest.raises(ValueError, match="gn_groups"):
        build_model("resnet18", 3, 10, 32, norm="gn", gn_groups=3)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("cnn2", 1, 0, 28)
    with pytest.raises(ValueError, match="body, head"):
        count_params(build_model("cnn2", 1, 10, 28), "neck")
    # a quoted "false" is a string, which Python reads as true: refused, not built with a bias
    with pytest.raises(ValueError, match="option fc_bias is true or false, got 'false': write fc_bias: true or "
                                         "fc_bias: false, unquoted"):
        build_model("resnet18", 3, 10, 32, fc_bias="false")
    with pytest.raises(ValueError, match="option relu_features is true or false, got 1"):
        build_model("fca_alexnet", 1, 10, 28, relu_features=1)


def test_resnet_without_a_classifier_bias_is_the_fednh_code_bases_resnet() -> None:
    # FedNH's ResNetMod (Tiny-ImageNet): GroupNorm(2) everywhere and a bias-free Linear head
    model = build_model("resnet18", 3, 200, 64, norm="gn", fc_bias=False)
    head = dict(model.named_parameters())
    assert "head.fc.weight" in head and "head.fc.bias" not in head and tuple(head["head.fc.weight"].shape) == (200, 512)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert {m.num_groups for m in model.modules() if isinstance(m, torch.nn.GroupNorm)} == {2}
    with_bias = build_model("resnet18", 3, 200, 64, norm="gn")
    assert count_params(with_bias) - count_params(model) == 200


@pytest.mark.parametrize("name", ["cnn2", "alexnet_fedrema", "resnet18"])
def test_functional_call_matches_forward(name: str) -> None:
    model = build_model(name, 3, 10, 32).eval()
    x = torch.randn(2, 3, 32, 32)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.allclose(functional_call(model, params, (x,)), model(x))
    h, logits = functional_call(model, params, (x,), {"with_features": True})
    assert torch.equal(h, model.features(x)) and torch.equal(logits, model(x))
    head_params = {n.removeprefix("head."): p for n, p in params.items() if n.startswith("head.")}
    assert torch.allclose(functional_call(model.head, head_params, (h,)), model.head(h))


def test_vmap_over_stacked_cnn2_params_matches_loop() -> None:
    models = [build_model("cnn2", 1, 10, 28) for _ in range(3)]
    stacked, _ = stack_module_state(models)
    template = models[0]

    def run(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(template, params, (x,))

    x = torch.randn(4, 1, 28, 28)
    shared = vmap(run, in_dims=(0, None))(stacked, x)
    assert shared.shape == (3, 4, 10)
    xs = torch.randn(3, 4, 1, 28, 28)
    per_model = vmap(run, in_dims=(0, 0))(stacked, xs)
    with torch.no_grad():
        for i, m in enumerate(models):
            assert torch.allclose(shared[i], m(x), atol=1e-6)
            assert torch.allclose(per_model[i], m(xs[i]), atol=1e-6)


# (max-pool, ReLU) pairs each builder has where its paper writes ReLU, then max-pool; FedReMa's
# AlexNet pools first in its authors' code too, so relu_before_pool's copy of it is not the paper's
POOL_BEFORE_RELU = {"cnn2": 2, "simple_cnn": 2, "alexnet_fedrema": 3}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_pooling_before_relu_gives_the_papers_values_and_gradients(name: str) -> None:
    """Where a builder max-pools before its ReLU, the papers' order (ReLU first) gives the same
    logits and the same gradients, bit for bit, on inputs with many non-positive pre-activations
    (no gradient in either order) and flat regions (tied maxima in the windows they cover)."""
    model = build_model(name, 1, 10, 28).eval()
    paper, swapped = relu_before_pool(model)
    assert swapped == POOL_BEFORE_RELU.get(name, 0)
    if not swapped:
        return
    x = torch.randn(8, 1, 28, 28) - 0.5
    x[:4, :, :14] = 1.0
    for m in (model, paper):
        m.zero_grad()
        nn.functional.cross_entropy(m(x), torch.arange(8) % 10).backward()
    assert torch.equal(model(x), paper(x))
    for (n, p), q in zip(model.named_parameters(), paper.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), n
