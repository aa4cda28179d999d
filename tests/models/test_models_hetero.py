"""Tests for FedClassAvg's heterogeneous models (fedhet.models.hetero).

Shapes at 1x28x28 and 3x32x32, the shared head (identical names and shapes on every
architecture), parameter counts against the published torchvision architectures counted layer
by layer here, the small CNN family, options and initialisation determinism.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fedhet.models import MODEL_NAMES, build_model, count_params, default_split, param_groups
from fedhet.training.dropout import batch_masks, masks_applied

PAPER_MODELS = ("fca_resnet18", "fca_shufflenetv2", "fca_googlenet", "fca_alexnet")
SMALL_CNNS = ("fca_cnn_a", "fca_cnn_b", "fca_cnn_c", "fca_cnn_d")
TINY_CNNS = ("fca_tiny_a", "fca_tiny_b", "fca_tiny_c", "fca_tiny_d")
FCA_MODELS = PAPER_MODELS + SMALL_CNNS + TINY_CNNS
INPUTS = [(1, 28), (3, 32)]
SMALL_CNN_LIMIT = 400_000  # whole model, 10 classes, either input
CLASSES = 10


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, int, int], nn.Module]:
    """Every model at both input shapes, built once (GoogLeNet and ResNet-18 take a moment)."""
    torch.manual_seed(0)
    return {(n, c, s): build_model(n, c, CLASSES, s) for n in FCA_MODELS for c, s in INPUTS}


# ---------------------------------------------------------------- counting by architecture tables
# Published torchvision parameter counts (torchvision.models documentation, "num_params", 3-channel
# input, 1000-way fc): resnet18 11,689,512; shufflenet_v2_x1_0 2,278,604; googlenet 6,624,904
# (GoogLeNet as published, i.e. with aux_logits=False). Minus the 1000-way fc (1024 or 512 inputs)
# they are the feature extractors' counts, which the functions below recount layer by layer from
# the architecture tables (He et al. 2016 Table 1; Ma et al. 2018 Table 5; Szegedy et al. 2015
# Table 1 with torchvision's 3x3 "5x5" branch).


def conv(cin: int, cout: int, k: int, groups: int = 1, bias: bool = False) -> int:
    return cin // groups * cout * k * k + (cout if bias else 0)


def bn(c: int) -> int:
    return 2 * c


def linear(cin: int, cout: int) -> int:
    return cin * cout + cout


def resnet18_trunk(cin: int) -> int:
    total = conv(cin, 64, 7) + bn(64)
    planes_in = 64
    for planes in (64, 128, 256, 512):
        for j in range(2):
            total += conv(planes_in, planes, 3) + bn(planes) + conv(planes, planes, 3) + bn(planes)
            if planes_in != planes:
                total += conv(planes_in, planes, 1) + bn(planes)
            planes_in = planes
    return total


def shufflenetv2_trunk(cin: int) -> int:
    total = conv(cin, 24, 3) + bn(24)
    cin_stage = 24
    for repeats, cout in ((4, 116), (8, 232), (4, 464)):
        half = cout // 2
        # strided unit: branch1 (depthwise 3x3, 1x1) and branch2 (1x1, depthwise 3x3, 1x1) on the input
        total += conv(cin_stage, cin_stage, 3, groups=cin_stage) + bn(cin_stage) + conv(cin_stage, half, 1) + bn(half)
        total += conv(cin_stage, half, 1) + bn(half) + conv(half, half, 3, groups=half) + bn(half)
        total += conv(half, half, 1) + bn(half)
        # stride-1 units: branch2 on half the channels
        unit = (
            conv(half, half, 1)
            + bn(half)
            + conv(half, half, 3, groups=half)
            + bn(half)
            + conv(half, half, 1)
            + bn(half)
        )
        total += (repeats - 1) * unit
        cin_stage = cout
    return total + conv(464, 1024, 1) + bn(1024)


GOOGLENET_INCEPTIONS = [
    (192, 64, 96, 128, 16, 32, 32),
    (256, 128, 128, 192, 32, 96, 64),
    (480, 192, 96, 208, 16, 48, 64),
    (512, 160, 112, 224, 24, 64, 64),
    (512, 128, 128, 256, 24, 64, 64),
    (512, 112, 144, 288, 32, 64, 64),
    (528, 256, 160, 320, 32, 128, 128),
    (832, 256, 160, 320, 32, 128, 128),
    (832, 384, 192, 384, 48, 128, 128),
]


def googlenet_trunk(cin: int) -> int:
    def basic(i: int, o: int, k: int) -> int:  # conv (no bias) + BatchNorm
        return conv(i, o, k) + bn(o)

    total = basic(cin, 64, 7) + basic(64, 64, 1) + basic(64, 192, 3)
    for i, a, b_red, b, c_red, c, pool in GOOGLENET_INCEPTIONS:
        total += basic(i, a, 1) + basic(i, b_red, 1) + basic(b_red, b, 3)
        total += basic(i, c_red, 1) + basic(c_red, c, 3) + basic(i, pool, 1)
    return total


def alexnet_trunk(cin: int) -> int:
    """The authors' alexnet_mnist convs and its first Linear (2304 -> 512)."""
    return (
        conv(cin, 64, 3, bias=True)
        + conv(64, 128, 3, bias=True)
        + conv(128, 256, 3, bias=True)
        + linear(256 * 3 * 3, 512)
    )


def test_layer_counts_match_published_torchvision_figures() -> None:
    assert resnet18_trunk(3) == 11_689_512 - linear(512, 1000) == 11_176_512
    assert shufflenetv2_trunk(3) == 2_278_604 - linear(1024, 1000) == 1_253_604
    assert googlenet_trunk(3) == 6_624_904 - linear(1024, 1000) == 5_599_904


# body = trunk + fcin; head = Linear(512, classes) (the ReLU has no parameters)
EXPECTED_BODY = {
    "fca_resnet18": lambda c: resnet18_trunk(c) + linear(512, 512),
    "fca_shufflenetv2": lambda c: shufflenetv2_trunk(c) + linear(1024, 512),
    "fca_googlenet": lambda c: googlenet_trunk(c) + linear(1024, 512),
    "fca_alexnet": lambda c: alexnet_trunk(c) + linear(512, 512),
    "fca_cnn_a": lambda c: conv(c, 16, 5, bias=True) + conv(16, 32, 5, bias=True) + linear(128, 512),
    "fca_cnn_b": lambda c: (
        conv(c, 32, 3, bias=True) + conv(32, 64, 3, bias=True) + conv(64, 128, 3, bias=True) + linear(128, 512)
    ),
    "fca_cnn_c": lambda c: (
        conv(c, 32, 3, bias=True)
        + conv(32, 32, 3, bias=True)
        + conv(32, 64, 3, bias=True)
        + conv(64, 64, 3, bias=True)
        + linear(64, 512)
    ),
    "fca_cnn_d": lambda c: conv(c, 64, 3, bias=True) + conv(64, 128, 3, bias=True) + linear(512, 512),
    "fca_tiny_a": lambda c: conv(c, 16, 5, bias=True) + linear(16 * 7 * 7, 512),
    "fca_tiny_b": lambda c: (
        conv(c, 16, 3, bias=True) + conv(16, 16, 3, bias=True) + conv(16, 32, 3, bias=True)
        + conv(32, 32, 3, bias=True) + linear(32, 512)
    ),
    "fca_tiny_c": lambda c: conv(c, 16, 3) + bn(16) + conv(16, 32, 3) + bn(32) + linear(128, 512),
    "fca_tiny_d": lambda c: (
        conv(c, 16, 5, bias=True) + conv(16, 32, 3, bias=True) + conv(32, 48, 3, bias=True) + linear(48, 512)
    ),
}


@pytest.mark.parametrize("name", FCA_MODELS)
@pytest.mark.parametrize(("in_channels", "image_size"), INPUTS)
def test_parameter_counts(built, name: str, in_channels: int, image_size: int) -> None:
    model = built[name, in_channels, image_size]
    assert count_params(model, "body") == EXPECTED_BODY[name](in_channels)
    assert count_params(model, "head") == linear(512, CLASSES)


def test_small_cnns_are_distinct_and_small(built) -> None:
    for c, s in INPUTS:
        counts = [count_params(built[n, c, s]) for n in SMALL_CNNS]
        assert len(set(counts)) == len(SMALL_CNNS)
        assert max(counts) < SMALL_CNN_LIMIT
        assert max(counts) < min(count_params(built[n, c, s]) for n in PAPER_MODELS)


def multiply_adds(model: nn.Module, shape: tuple[int, ...]) -> int:
    """Multiply-adds of one sample's forward pass through the convolutions and linears."""
    total = 0

    def count(module: nn.Module, _inputs: object, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            total += out[0].numel() * module.in_channels // module.groups * kh * kw
        elif isinstance(module, nn.Linear):
            total += module.in_features * module.out_features

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, *shape))
    for h in hooks:
        h.remove()
    return total


def test_tiny_cnns_each_cost_less_than_cnn2_per_sample(built) -> None:
    """The CPU federation's promise: every member is cheaper per 28x28 sample than cnn2 (McMahan et
    al.'s CNN), hand-counted for cnn2 and fca_tiny_a."""
    cnn2 = multiply_adds(build_model("cnn2", 1, CLASSES, 28), (1, 28, 28))
    assert cnn2 == 24 * 24 * 32 * 25 + 8 * 8 * 64 * 32 * 25 + 1024 * 512 + 512 * CLASSES
    assert multiply_adds(built["fca_tiny_a", 1, 28], (1, 28, 28)) == 28 * 28 * 16 * 25 + 784 * 512 + 512 * CLASSES
    for name in TINY_CNNS:
        assert multiply_adds(built[name, 1, 28], (1, 28, 28)) < cnn2 / 2, name
    assert any(isinstance(m, nn.BatchNorm2d) for m in built["fca_tiny_c", 1, 28].modules())


def test_small_cnns_are_distinct_architectures(built) -> None:
    layouts = {
        n: tuple(
            (type(m).__name__, tuple(p.shape)) for m in built[n, 1, 28].body.modules() for p in m.parameters(False)
        )
        for n in SMALL_CNNS + TINY_CNNS
    }
    assert len(set(layouts.values())) == len(SMALL_CNNS + TINY_CNNS)


# -------------------------------------------------------------------------------- shapes, heads


def test_registry_lists_fca_models_with_classifier_split() -> None:
    assert set(FCA_MODELS) <= set(MODEL_NAMES)
    assert all(default_split(n) == "classifier" for n in FCA_MODELS)


@pytest.mark.parametrize("name", FCA_MODELS)
@pytest.mark.parametrize(("in_channels", "image_size"), INPUTS)
def test_shapes_and_512d_features(built, name: str, in_channels: int, image_size: int) -> None:
    model = built[name, in_channels, image_size].eval()
    assert model.feature_dim == 512 and model.feature_shape == (512,)
    assert model.stage_names[-2:] == ("fcin", "classifier")
    x = torch.randn(2, in_channels, image_size, image_size)
    with torch.no_grad():
        h, logits = model(x, with_features=True)
        assert h.shape == (2, 512) and logits.shape == (2, CLASSES)
        assert torch.equal(model.head(h), logits)
        assert torch.equal(model.features(x), h)
        # the feature is the fcin output, no activation after it
        assert (h < 0).any()
        assert torch.allclose(h, model.body.fcin(model.body[:-1](x).flatten(1)))


@pytest.mark.parametrize("name", FCA_MODELS)
def test_train_mode_backward_reaches_every_parameter(built, name: str) -> None:
    model = built[name, 1, 28].train()
    model.zero_grad()
    x = torch.randn(2, 1, 28, 28)
    with masks_applied(batch_masks(model, x, torch.Generator().manual_seed(0))):   # dropout's, as training draws them
        model(x).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    model.zero_grad()
    model.eval()


def test_heads_identical_across_architectures(built) -> None:
    expected = {"head.classifier.1.weight": (CLASSES, 512), "head.classifier.1.bias": (CLASSES,)}
    for (name, _, _), model in built.items():
        head = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("head.")}
        assert head == expected, name
        assert param_groups(model)["head"] == list(expected)
        assert isinstance(model.head.classifier[0], nn.ReLU)
        assert [n for n, _ in model.head.named_buffers()] == []


def test_head_weights_load_across_architectures(built) -> None:
    """FedClassAvg's exchange: a head state from one architecture loads into every other."""
    source = built["fca_resnet18", 1, 28]
    head = {k: v.clone() for k, v in source.head.state_dict().items()}
    for name in FCA_MODELS:
        target = built[name, 1, 28]
        target.head.load_state_dict(head)
        assert torch.equal(target.head.classifier[1].weight, head["classifier.1.weight"])


@pytest.mark.parametrize(
    ("name", "stem", "shape"),
    [
        ("fca_resnet18", "stem.conv", (64, 1, 7, 7)),
        ("fca_shufflenetv2", "stem.conv", (24, 1, 3, 3)),
        ("fca_googlenet", "stem.conv1.conv", (64, 1, 7, 7)),
        ("fca_alexnet", "conv1.0", (64, 1, 3, 3)),
    ],
)
def test_fmnist_stems(built, name: str, stem: str, shape: tuple[int, ...]) -> None:
    conv1 = built[name, 1, 28].body.get_submodule(stem)
    assert tuple(conv1.weight.shape) == shape
    assert tuple(built[name, 3, 32].body.get_submodule(stem).weight.shape) == (shape[0], 3, *shape[2:])
    stride = {"fca_alexnet": (1, 1)}.get(name, (2, 2))
    assert conv1.stride == stride


def test_googlenet_has_no_auxiliary_heads_and_torchvision_norm_eps(built) -> None:
    model = built["fca_googlenet", 3, 32]
    assert not any("aux" in n for n, _ in model.named_modules())
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.eps == 1e-3 for m in bns)
    assert len([m for m in model.modules() if type(m).__name__ == "Inception"]) == 9


def test_shufflenet_unit_counts(built) -> None:
    body = built["fca_shufflenetv2", 3, 32].body
    assert [len(body.get_submodule(s)) for s in ("stage2", "stage3", "stage4")] == [4, 8, 4]


# -------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("name", "min_size"),
    [("fca_googlenet", 15), ("fca_alexnet", 3), ("fca_cnn_a", 4), ("fca_cnn_b", 8), ("fca_cnn_c", 4), ("fca_cnn_d", 4),
     ("fca_tiny_a", 4), ("fca_tiny_b", 4), ("fca_tiny_c", 4), ("fca_tiny_d", 4)],
)
def test_too_small_images_name_the_minimum(name: str, min_size: int) -> None:
    with pytest.raises(ValueError, match=f"image_size >= {min_size}"):
        build_model(name, 1, CLASSES, min_size - 1)
    if name != "fca_googlenet":  # the smallest valid size builds (GoogLeNet: slow, checked at 28)
        assert build_model(name, 1, CLASSES, min_size).feature_dim == 512


def test_dropout_is_on_as_published_and_can_be_set_or_left_out(built) -> None:
    """GoogLeNet keeps torchvision's 0.2 after the pool (the authors replace only fc), AlexNet has the
    authors' 0.5 before its first Linear; the other two have none. dropout=0 leaves the layer out."""
    published = {"fca_googlenet": [0.2], "fca_alexnet": [0.5]}
    for (name, _, _), model in built.items():
        assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == published.get(name, []), name
    g = built["fca_googlenet", 1, 28]
    assert isinstance(g.body.pool[2], nn.Dropout)
    a = build_model("fca_alexnet", 1, CLASSES, 28, dropout=0.3)
    assert isinstance(a.body.fc[0], nn.Dropout) and a.body.fc[0].p == 0.3
    assert count_params(a) == count_params(built["fca_alexnet", 1, 28])
    for name in published:
        plain = build_model(name, 1, CLASSES, 28, dropout=0)
        assert not any(isinstance(m, nn.Dropout) for m in plain.modules())
    with pytest.raises(ValueError, match="dropout"):
        build_model("fca_alexnet", 1, CLASSES, 28, dropout=1.0)
    with pytest.raises(ValueError, match="does not take"):
        build_model("fca_resnet18", 1, CLASSES, 28, dropout=0.2)


def test_group_norm_option() -> None:
    model = build_model("fca_shufflenetv2", 1, CLASSES, 28, norm="gn")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert list(model.buffers()) == []
    with pytest.raises(ValueError, match="gn_groups=3"):
        build_model("fca_shufflenetv2", 1, CLASSES, 28, norm="gn", gn_groups=3)
    with pytest.raises(ValueError, match="no normalization layers"):
        build_model("fca_cnn_a", 1, CLASSES, 28, norm="gn")


# ------------------------------------------------------------------------- determinism, torch.func


@pytest.mark.parametrize("name", FCA_MODELS)
def test_initialisation_is_deterministic_under_a_seed(name: str) -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(name, 1, CLASSES, 28).state_dict()

    first, again, other = weights(1), weights(1), weights(2)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())


@pytest.mark.parametrize("name", ["fca_shufflenetv2", "fca_alexnet"])
def test_functional_call_matches_forward(built, name: str) -> None:
    model = built[name, 1, 28].eval()
    x = torch.randn(2, 1, 28, 28)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        h, logits = functional_call(model, weights, (x,), {"with_features": True})
        assert torch.allclose(h, model.features(x), atol=1e-6)
        assert torch.allclose(logits, model(x), atol=1e-6)


def test_vmap_over_stacked_small_cnns() -> None:
    models = [build_model("fca_cnn_c", 1, CLASSES, 28) for _ in range(3)]
    params, _ = stack_module_state(models)
    x = torch.randn(3, 2, 1, 28, 28)
    out = vmap(lambda p, xi: functional_call(models[0], p, (xi,)))(params, x)
    with torch.no_grad():
        for i, m in enumerate(models):
            assert torch.allclose(out[i], m(x[i]), atol=1e-6)


# ---------------------------------------------------------------- relu_features (prototype methods)
@pytest.mark.parametrize("name", ["fca_cnn_a", "fca_alexnet"])
def test_relu_features_moves_the_relu_into_the_body_without_changing_the_logits(name):
    torch.manual_seed(1)
    plain = build_model(name, 1, CLASSES, 28)
    moved = build_model(name, 1, CLASSES, 28, relu_features=True)
    assert list(moved.state_dict()) == list(plain.state_dict())               # same names: weights interchange
    moved.load_state_dict(plain.state_dict())
    plain.eval(), moved.eval()
    x = torch.randn(6, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(moved(x), plain(x), rtol=0, atol=0)
        raw = plain.body(x)
        assert (raw < 0).any()                                                 # the default features are unactivated
        torch.testing.assert_close(moved.body(x), torch.relu(raw), rtol=0, atol=0)
    assert param_groups(moved)["head"] == ["head.classifier.1.weight", "head.classifier.1.bias"]
