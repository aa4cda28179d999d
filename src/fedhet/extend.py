"""What a method, a model or a loss term of your own may import from fedhet: the stable names.

A method is a subclass of :class:`FedAvg` (or :class:`Algorithm`) that overrides hooks; a model is
a builder returning a :class:`SplitModel`; a loss term is a :class:`LossTerm`. A config names
them by import path (``algorithm.name: mylab.methods:FedFoo``, ``model.arch: mylab.nets:tiny``;
a dataset function and a partition function likewise, ``data.dataset``, ``data.partition.kind``),
and every engine runs them as it runs the built-in ones (docs/extending.md). Names not listed here
are internal and may change.
"""

from __future__ import annotations

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.base import Algorithm, update_reply
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientData,
    ClientRuntime,
    Forward,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    State,
    TrainSettings,
)
from fedhet.core.errors import ConfigError
from fedhet.core.split import BODY, HEAD, linear_classifier, select
from fedhet.data.user_data import save_arrays
from fedhet.models.base import SplitModel
from fedhet.training.augment import mixed
from fedhet.training.dropout import StreamDropout
from fedhet.training.local import trained_names
from fedhet.training.objective import CrossEntropy, LossTerm

__all__ = [
    "Algorithm",
    "Arrays",
    "BODY",
    "Batch",
    "ClientData",
    "ClientRuntime",
    "ConfigError",
    "CrossEntropy",
    "FedAvg",
    "Forward",
    "HEAD",
    "LocalResult",
    "LossTerm",
    "Message",
    "Replies",
    "RoundContext",
    "SplitModel",
    "State",
    "StreamDropout",
    "TrainSettings",
    "linear_classifier",
    "mixed",
    "save_arrays",
    "select",
    "trained_names",
    "update_reply",
    "weighted_average",
]
