"""The vectorized engine: many clients' local training as one ``torch.func.vmap`` computation.

The algorithm contract stays untouched: every client of a phase runs its ordinary
``client_update`` in its own thread, and ``client.train(...)`` does not train but posts a request
and blocks (:mod:`.baton`). When every client of the phase is blocked in ``train`` or finished,
the engine groups the pending requests (:mod:`.grouping`), stacks each group's weights along a new
client dimension and trains the group in one loop: a schedule of buckets of clients at one batch
size (:mod:`.schedule`), each bucket one vmapped step (:mod:`.step`) with local training's SGD or
Adam kernel on the stacked tensors (:mod:`.kernels`), recurring steps replayed as CUDA graphs on
CUDA (:mod:`.graphs`); the group is then unstacked into one result per client (:mod:`.results`).
:mod:`.transport` ties them together as :class:`Vectorized`.

Exactness: batch order, initial state, optimizer rule and loss are the reference's, but vmapped
convolutions run as grouped convolutions and batched matmuls, whose float summation order differs,
so results equal the reference to float tolerance, not bitwise (tests/engine/test_engine_vectorized.py
says how close). With ReLU/max-pool models a pre-activation within rounding of a kink occasionally
takes the other side, and in a chaotic regime (large lr with momentum 0.9) any two float-different
runs drift apart, this engine and the reference included. On CUDA the loop runs with TF32 off
(torch's default lets cuDNN convolutions use it): ``precision: fp32`` means fp32 on every device.

What falls back to the reference path (``train_local``, exact, on the client host's device):
requests with a loss term that does not declare itself pure (``LossTerm.vectorizable``), Adam
requests that carry an optimizer state from an earlier call (their clients' step counts differ),
requests whose ``augment`` is an opaque callable rather than a
:class:`fedhet.training.augment.Augmentation`, requests with zero steps, and - when
``fallback_on_error`` is true - a group whose vmapped step raises (a term that turns out not to be
vmappable). A method that trains in its own loop instead of ``client.train`` (Per-FedAvg's meta
steps) is never seen by the engine and trains one client at a time; ``ClientRuntime.account``
reports it. ``Vectorized.counters`` counts them all, and ``fallback_reasons`` (in the run's summary)
says why, per reason. Other client code outside ``train`` (prototypes, features, SCAFFOLD option I's
full gradient, evaluation) runs per client in every engine: it is the method's, not a fallback.

Augmentation (FedACD's mixup, FedClassAvg's two views): an ``Augmentation`` splits into ``draw``
(every random draw of a batch, on the host) and ``apply`` (tensor arithmetic). The schedule takes
each batch's draws from the client's stream right after its positions, as ``train_local`` does,
sends them to the device with the schedule, and each step applies them per client under ``vmap``
before the forward pass. Requests whose augmentations share a ``signature`` train in one group.

Device: the engine trains on ``device``; the client host (``run.device``, normally the same
device) runs the clients' own code there too - messages and client state arrive on it and the
trained weights stay on it until the host hands the reply back to the CPU (engine/host.py). With a
CPU host and a CUDA engine (tests, benchmarks) the data pool is copied to the device once and the
results come back to the CPU.
"""

from fedhet.engine.vectorized.baton import ClientTask
from fedhet.engine.vectorized.graphs import GRAPH_MIN_REPEATS
from fedhet.engine.vectorized.grouping import KEPT_GROUPS
from fedhet.engine.vectorized.transport import Vectorized, available
from fedhet.training.precision import strict_fp32, tf32_allowed  # the precision switches the engine trains under

# The name the engine's interrupt test patches (tests/engine/test_engine_vectorized.py).
_Task = ClientTask

__all__ = ["GRAPH_MIN_REPEATS", "KEPT_GROUPS", "ClientTask", "Vectorized", "available", "strict_fp32", "tf32_allowed"]
