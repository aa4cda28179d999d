"""What a method, a model or a loss term of your own may import from fedhet: the stable names.

A method is a subclass of :class:`FedAvg` (or :class:`Algorithm`) that overrides hooks; a model is
a builder returning a :class:`SplitModel`; a loss term is a :class:`LossTerm`. A config names
them by import path (``algorithm.name: mylab.methods:FedFoo``, ``model.arch: mylab.nets:tiny``;
a dataset function and a partition function likewise, ``data.dataset``, ``data.partition.kind``),
and every engine runs them as it runs the built-in ones (docs/extending.md). The built-in methods'
building blocks are here too: another set of weights' forward pass (``forward``), augmentations the
vectorized engine batches (``Augmentation``), labels read the way a mixed batch needs them
(``mixed``, ``label_weights``), multi-phase and hand-written training (``train_head_then_body``,
``concatenate_results``, ``epoch_batches``, ``total_loss``, ``check_finite``, ``in_mode``, and a
training pass's dropout masks from the client's stream, ``batch_masks`` and ``masks_applied``), the
loss terms several built-in methods share (``Proximal``, ``Linear``, ``OffsetCrossEntropy``), class
statistics and prototypes (``class_statistics``, ``aggregate_prototypes``), a server's extra phases
(``RoundGenerator``, what ``round`` returns), and the weights a server rule acts on
(``server_trainable``, ``check_buffers_known_to_server``). Names not listed here are internal and
may change.
"""

from __future__ import annotations

from fedhet.algorithms.aggregate import check_buffers_known_to_server, server_trainable, weighted_average
from fedhet.algorithms.base import Algorithm, add_reasons, update_reply
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.prototypes import ClassStatistics, aggregate_prototypes, class_statistics
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
    RoundGenerator,
    State,
    TrainSettings,
)
from fedhet.core.errors import ConfigError, NumericalError
from fedhet.core.split import BODY, HEAD, linear_classifier, select
from fedhet.data.user_data import save_arrays
from fedhet.models.base import SplitModel
from fedhet.training.augment import Augmentation, label_weights, mixed
from fedhet.training.dropout import StreamDropout, batch_masks, masks_applied
from fedhet.training.local import (
    check_finite,
    concatenate_results,
    epoch_batches,
    forward,
    trained_names,
    trains_in_channels_last,
)
from fedhet.training.mode import in_mode
from fedhet.training.objective import CrossEntropy, LossTerm, total_loss
from fedhet.training.phases import train_head_then_body
from fedhet.training.terms import Linear, OffsetCrossEntropy, Proximal

__all__ = [
    "Algorithm",
    "Arrays",
    "Augmentation",
    "BODY",
    "Batch",
    "ClassStatistics",
    "ClientData",
    "ClientRuntime",
    "ConfigError",
    "CrossEntropy",
    "FedAvg",
    "Forward",
    "HEAD",
    "Linear",
    "LocalResult",
    "LossTerm",
    "Message",
    "NumericalError",
    "OffsetCrossEntropy",
    "Proximal",
    "Replies",
    "RoundContext",
    "RoundGenerator",
    "SplitModel",
    "State",
    "StreamDropout",
    "TrainSettings",
    "add_reasons",
    "aggregate_prototypes",
    "batch_masks",
    "check_buffers_known_to_server",
    "check_finite",
    "class_statistics",
    "concatenate_results",
    "epoch_batches",
    "forward",
    "in_mode",
    "label_weights",
    "linear_classifier",
    "masks_applied",
    "mixed",
    "save_arrays",
    "select",
    "server_trainable",
    "total_loss",
    "train_head_then_body",
    "trained_names",
    "trains_in_channels_last",
    "update_reply",
    "weighted_average",
]
