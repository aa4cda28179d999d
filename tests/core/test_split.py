"""The body/head split helpers (fedhet.core.split) on small models whose names are known by hand."""

import pytest
import torch
from torch import nn

from fedhet.core.errors import ConfigError
from fedhet.core.split import BODY, HEAD, is_body, is_head, linear_classifier, linear_head_names, select, strip_prefix
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
    m = model([("fc", nn.Sequential(nn.Dropout(0.5), nn.Flatten(), nn.Linear(18, 4)))])     # identities at evaluation
    assert linear_classifier(m, "FedROD") == ("head.fc.2.weight", "head.fc.2.bias")


@pytest.mark.parametrize("head,fix", [
    ([("fc1", nn.Sequential(nn.Linear(18, 6), nn.ReLU())), ("fc", nn.Linear(6, 4))],     # two Linear layers
     r"set model.split to the stage of its last Linear layer \('fc'\)"),
    ([("fc", nn.Sequential(nn.Linear(18, 4), nn.BatchNorm1d(4)))],                       # a Linear and other parameters
     r"leave model.split at the architecture's default"),
], ids=["two_linears", "linear_and_norm"])
def test_linear_classifier_refuses_any_other_head(head, fix):
    split = head[0][0]
    with pytest.raises(ConfigError, match=r"^FedRS needs a linear classifier: the model's head \(from model.split on\) "
                                          rf"must be a single Linear layer; {fix} "
                                          r"\(a model of one's own: end it in one nn.Linear stage and split there\)$"):
        linear_classifier(model(head, split), "FedRS")
    with pytest.raises(ConfigError, match=r"^FedRS needs a linear classifier: model net's head \(from model.split on\)"):
        linear_classifier(model(head, split), "FedRS", "net")
    # the same read from the weights alone, as the server names the head's tensors
    assert linear_head_names(model(head, split).state_dict()) is None


def test_linear_classifier_refuses_an_activation_before_the_linear_layer():
    """FedClassAvg's heads are ReLU + Linear: one Linear's parameters, but logits of relu(h), not of h."""
    m = model([("fc", nn.Sequential(nn.ReLU(), nn.Linear(18, 4)))])
    assert linear_head_names(m.state_dict()) == ("head.fc.1.weight", "head.fc.1.bias")     # the weights cannot tell
    with pytest.raises(ConfigError, match=r"^FedROD needs a linear classifier: the model's head applies ReLU besides its "
                                          r"Linear layer, .* set model.options.relu_features: true"):
        linear_classifier(m, "FedROD")


def test_linear_head_names_from_weights():
    assert linear_head_names(model([("fc", nn.Linear(18, 4))]).state_dict()) == ("head.fc.weight", "head.fc.bias")
    assert linear_head_names(model([("fc", nn.Linear(18, 4, bias=False))]).state_dict()) == ("head.fc.weight", None)
    assert linear_head_names(model([("fc", nn.Sequential(nn.Identity(), nn.Linear(18, 4)))]).state_dict()) == (
        "head.fc.1.weight", "head.fc.1.bias")
