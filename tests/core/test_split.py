"""The body/head split helpers (fedhet.core.split) on small models whose names are known by hand."""

import pytest
import torch
from torch import nn

from fedhet.core.errors import ConfigError
from fedhet.core.split import BODY, HEAD, is_body, is_head, is_linear_head, linear_classifier, select, strip_prefix
from fedhet.models.base import SplitModel


def model(head_stages, split="fc"):
    stages = [("conv", nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())), *head_stages]
    return SplitModel(stages, split, (1, 5, 5))


def test_prefix_helpers_select_and_strip_by_name():
    w = {"body.conv.0.weight": torch.zeros(1), "head.fc.weight": torch.ones(1), "head.fc.bias": torch.ones(2)}
    assert [is_body(k) for k in w] == [True, False, False]
    assert [is_head(k) for k in w] == [False, True, True]
    assert list(select(w, HEAD)) == ["head.fc.weight", "head.fc.bias"]
    assert list(select(w, BODY)) == ["body.conv.0.weight"]
    stripped = strip_prefix(w, HEAD)
    assert list(stripped) == ["fc.weight", "fc.bias"] and stripped["fc.bias"] is w["head.fc.bias"]


def test_linear_classifier_names_the_single_linear_head():
    m = model([("fc", nn.Linear(18, 4))])
    assert linear_classifier(m, "FedRS") == ("head.fc.weight", "head.fc.bias")


def test_linear_classifier_without_bias_names_no_bias():
    m = model([("fc", nn.Linear(18, 4, bias=False))])
    assert linear_classifier(m, "FedNH") == ("head.fc.weight", None)


def test_linear_classifier_inside_a_stage_keeps_its_path():
    m = model([("fc", nn.Sequential(nn.Identity(), nn.Linear(18, 4)))])
    assert linear_classifier(m, "FedROD") == ("head.fc.1.weight", "head.fc.1.bias")


@pytest.mark.parametrize("head", [
    [("fc1", nn.Sequential(nn.Linear(18, 6), nn.ReLU())), ("fc", nn.Linear(6, 4))],   # two Linear layers
    [("fc", nn.Sequential(nn.Linear(18, 4), nn.BatchNorm1d(4)))],                     # a Linear and other parameters
], ids=["two_linears", "linear_and_norm"])
def test_linear_classifier_refuses_any_other_head(head):
    split = head[0][0]
    with pytest.raises(ConfigError, match=r"^FedRS needs a linear classifier: the model's head \(from model.split on\) "
                                          r"must be a single Linear layer; leave model.split at the architecture's default "
                                          r"\(a model of one's own: end it in one nn.Linear stage and split there\)$"):
        linear_classifier(model(head, split), "FedRS")
    # the same read from the weights alone, as FedROD refuses such a model before round 1
    assert not is_linear_head(model(head, split).state_dict())


def test_is_linear_head_from_weights():
    assert is_linear_head(model([("fc", nn.Linear(18, 4))]).state_dict())
    assert is_linear_head(model([("fc", nn.Linear(18, 4, bias=False))]).state_dict())
    assert is_linear_head(model([("fc", nn.Sequential(nn.Identity(), nn.Linear(18, 4)))]).state_dict())
