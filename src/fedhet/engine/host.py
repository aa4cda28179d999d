"""Running one client's update in this process: the runtime a client function sees.

:class:`ClientHost` holds what any process that runs clients needs - the algorithm, the
federation's data, one model instance per architecture, the training settings and the run
seed - and turns a :class:`Job` (message, client state, the round's tally of that client so far)
into a :class:`JobResult` (reply, new state, updated tally). The in-process, forked-worker and
vectorized transports and a Flower node all run clients through it, so a client's computation
is the same code everywhere.

Optimizer state across rounds (``train.optimizer_state``, resolved per run by
:meth:`ClientHost.keeps_optimizer_state`) is the host's business, so every method honours it
without code of its own: with "keep" the host takes the client's optimizer state out of its
client state (key :data:`OPTIMIZER_STATE`) before ``client_update``, hands it to every
``client.train`` call that does not pass its own, merges each call's final state back by
parameter name (a phase that freezes some parameters keeps their buffers) and stores the union
in the new client state. A method that carries state within a round (FedACD's per-epoch calls)
still passes it explicitly.

Device: a host built with ``device`` (``run.device``) runs its clients there. The federation's
uint8 pool, labels and normalisation are copied to the device once (:meth:`ClientHost.client_data`),
each architecture has a device copy of its model, and :meth:`ClientHost.run` moves the job's
message and client state to the device before ``client_update`` and the reply back to the CPU
after it, so messages stay device-agnostic (Flower, checkpoints, the server's code) and every
method's client code - training, its own forward passes, augmentation - runs on the device without
code of its own. The new client state goes back to the CPU too, unless the host keeps it on the
device (``state_on_device``, ``run.client_state: device``): then it moves no more, and the loop's
snapshot for a checkpoint copies it to the CPU. Random streams stay CPU generators: a draw is the
same on every device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fedhet.algorithms.base import Algorithm
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientData,
    LocalResult,
    Message,
    State,
    TrainSettings,
    optimizer_state_kept,
    to_device,
)
from fedhet.core.seeding import torch_generator
from fedhet.data.federated import Federation
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy, LossTerm, check_terms_take_mixup

# Client-state key of the optimizer state the host keeps across rounds (train.optimizer_state: keep).
OPTIMIZER_STATE = "optimizer_state"


@dataclass
class Tally:
    """What a client trained in the current round so far (all phases): accounted by ``account``."""

    samples: int = 0
    loss_sum: float | None = None      # sum over steps of the step loss (None before any step)
    steps: int = 0

    def add(self, result: LocalResult) -> None:
        self.samples += result.samples
        self.loss_sum = (self.loss_sum or 0.0) + result.mean_loss * result.steps
        self.steps += result.steps


@dataclass
class Job:
    """One client's part of a phase: its message, its persistent state and its round tally so far."""

    cid: int
    message: Message
    state: State | None
    tally: Tally


@dataclass
class JobResult:
    reply: Message
    state: State | None
    tally: Tally                       # the job's tally plus what this phase trained


class SimClient:
    """The :class:`fedhet.core.contract.ClientRuntime` of one client in one round, in this process."""

    def __init__(self, host: ClientHost, cid: int, rnd: int, tally: Tally):
        self.host = host
        self.cid = cid
        self.round = rnd
        self.arch = host.client_arch[cid]
        self.model = host.client_models[self.arch]
        self.num_classes = host.federation.num_classes
        self.data: ClientData = host.client_data(cid)
        self.num_samples = len(self.data.train_idx)
        self.buffer_names = host.buffer_names[self.arch]
        self.settings = host.round_settings(rnd)
        self.tally = tally
        # The optimizer state carried across rounds when the run keeps it (None: not kept).
        self.kept_optimizer_state: Arrays | None = None
        self.train_augmentations: list[Callable[..., Batch]] = []

    def where(self, stream: str = "batches") -> str:
        """Where an error happened; a training apart from the client's own names its stream."""
        apart = f" (its {stream!r} training)" if stream != "batches" else ""
        return f"in round {self.round + 1}, client {self.cid}, algorithm {self.host.algorithm.name}{apart}"

    def train(self, weights: Arrays, terms: list[LossTerm] | None = None, *, epochs: int | None = None,
              start_epoch: int = 0, trainable: Callable[[str], bool] | None = None,
              optimizer_state: Arrays | None = None, augment: Callable[..., Batch] | None = None,
              statistics: dict[str, torch.Tensor] | None = None, carry_optimizer_state: bool = True,
              data: ClientData | None = None, settings: TrainSettings | None = None,
              stream: str = "batches") -> LocalResult:
        terms = terms if terms is not None else [CrossEntropy()]
        check_terms_take_mixup(terms, augment, f"({self.where(stream)})")
        if augment is not None:
            self.train_augmentations.append(augment)
        s = settings if settings is not None else self.settings
        if epochs is not None:
            s = replace(s, epochs=epochs)
        # A training apart from the client's own (FedBABU's fine-tune for evaluation, KT-pFL's
        # distillation) starts from a fresh optimizer and leaves the kept state alone: training
        # must not depend on how often the run evaluates.
        kept = self.kept_optimizer_state if carry_optimizer_state else None
        if kept is not None and optimizer_state is None:
            optimizer_state = kept
        result = self.fit(weights, terms, s, data=data if data is not None else self.data, stream=stream,
                          start_epoch=start_epoch, trainable=trainable, optimizer_state=optimizer_state,
                          augment=augment, statistics=statistics)
        if kept is not None:
            kept.update(result.optimizer_state)
        self.account(result)
        return result

    def fit(self, weights: Arrays, terms: list[LossTerm], settings: TrainSettings, *, data: ClientData, stream: str,
            start_epoch: int, trainable: Callable[[str], bool] | None, optimizer_state: Arrays | None,
            augment: Callable[..., Batch] | None, statistics: dict[str, torch.Tensor] | None) -> LocalResult:
        """The local training itself: ``train_local`` here; the vectorized engine serves it instead."""
        return train_local(self.model, weights, data, terms, settings, lambda e: self.generator(stream, e),
                           start_epoch=start_epoch, trainable=trainable, optimizer_state=optimizer_state,
                           augment=augment, statistics=statistics, where=self.where(stream))

    def account(self, result: LocalResult) -> None:
        self.tally.add(result)

    def generator(self, *purpose: int | str) -> torch.Generator:
        return torch_generator(self.host.seed, "client", self.round, self.cid, *purpose)

    def init_weights(self) -> Arrays:
        return {k: v.to(self.host.device, copy=True) for k, v in self.host.init_models[self.arch].items()}


class ClientHost:
    """Everything needed to run clients' updates in this process (see the module docstring)."""

    def __init__(self, algorithm: Algorithm, federation: Federation, models: dict[str, torch.nn.Module],
                 client_arch: list[str], settings: TrainSettings, seed: int, device: str | torch.device = "cpu",
                 state_on_device: bool = False, lr_decay: float = 1.0):
        for arch, model in models.items():
            algorithm.check_model(arch, model)      # refuse a model the method cannot use before round 1
        self.algorithm = algorithm
        self.federation = federation
        self.models = models
        self.client_arch = client_arch
        self.settings = settings           # the first round's: see round_settings
        self.lr_decay = lr_decay
        self.seed = seed
        self.buffer_names = {a: [n for n, _ in m.named_buffers()] for a, m in models.items()}
        # The models arrive freshly built from the run seed (experiment.build.build_models); their
        # weights are the common initialisation of each architecture.
        self.init_models = {a: {k: v.detach().clone() for k, v in m.state_dict().items()}
                            for a, m in models.items()}
        self.device = torch.device(device)
        # Where client states live between jobs (module docstring).
        self.state_device = self.device if state_on_device else torch.device("cpu")
        # The models clients run (``models`` stay on the CPU for the server's and evaluation's use).
        self.client_models = models if self.on_cpu else {
            a: copy.deepcopy(m).to(self.device) for a, m in models.items()}
        self._device_pool: tuple | None = None
        self._device_idx: dict[int, torch.Tensor] = {}

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def client_data(self, cid: int) -> ClientData:
        """Client ``cid``'s view of the pools, on the host's device (copied there once)."""
        fed = self.federation
        if self._device_pool is None:   # on the CPU, to_device hands back the very same tensors
            self._device_pool = to_device((fed.pool.x, fed.pool.y, fed.mean, fed.std, fed.public), self.device)
        if cid not in self._device_idx:
            self._device_idx[cid] = fed.train_idx[cid].to(self.device)
        x, y, mean, std, public = self._device_pool
        return ClientData(x, y, self._device_idx[cid], mean, std, public)

    def release(self) -> None:
        """Free the device copies of the data (the end of a run)."""
        self._device_pool = None
        self._device_idx.clear()

    def round_settings(self, rnd: int) -> TrainSettings:
        """The settings clients train with in round ``rnd`` (0-based): the learning rate decayed by
        ``lr_decay`` once a round (``train.lr_decay``), the rest as given."""
        if self.lr_decay == 1.0:
            return self.settings
        return replace(self.settings, lr=self.settings.lr * self.lr_decay ** rnd)

    def runtime(self, cid: int, rnd: int, tally: Tally) -> SimClient:
        return SimClient(self, cid, rnd, tally)

    @property
    def keeps_optimizer_state(self) -> bool:
        """Whether clients' optimizer states persist across rounds: ``train.optimizer_state``
        "keep", or "auto" with a method that keeps them (FedReMa)."""
        return optimizer_state_kept(self.settings.optimizer_state, self.algorithm.keeps_optimizer_state)

    def run(self, rnd: int, job: Job, runtime: SimClient | None = None) -> JobResult:
        """``algorithm.client_update`` of one job. ``runtime`` (default: this host's) must carry a
        copy of the job's tally, so a failed job changes nothing the loop holds."""
        client = runtime or self.runtime(job.cid, rnd, replace(job.tally))
        # On the CPU these moves hand back the same tensors (no copy): one code path on every device.
        message, state = to_device(job.message, self.device), to_device(job.state, self.device)
        if not self.keeps_optimizer_state:
            reply, state = self.algorithm.client_update(message, state, client)
        else:
            kept = dict(state.get(OPTIMIZER_STATE) or {}) if state else {}
            if state and OPTIMIZER_STATE in state:
                state = {k: v for k, v in state.items() if k != OPTIMIZER_STATE} or None
            client.kept_optimizer_state = kept
            reply, state = self.algorithm.client_update(message, state, client)
            if kept:
                state = {**(state or {}), OPTIMIZER_STATE: kept}
        # On CUDA the reply's copies back are queued and waited for once, not tensor by tensor: each
        # wait idles the device while the host catches up (FedCME's replies made 3.8x FedAvg's waits).
        # Queued copies land in pinned memory, which a reply (dropped after aggregation) may hold but
        # clients' kept state must not: pinned blocks are scarce and rounded up to powers of two.
        queued = self.device.type == "cuda"
        reply = to_device(reply, "cpu", queued)
        state = to_device(state, self.state_device)
        if queued:
            torch.cuda.current_stream(self.device).synchronize()
        return JobResult(reply, state, client.tally)
