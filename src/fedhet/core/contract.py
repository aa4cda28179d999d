"""The types every layer shares: messages, round contexts, client data, training settings and results.

It imports nothing from fedhet (only torch and numpy), so it sits at the bottom of the import
graph (the ``fedhet.core`` layer of docs/architecture.md) and loss terms, local training,
algorithms, data, engines and the experiment layer all use the same types.

* :data:`Arrays` / :data:`State` - named tensors (weights, a message's group), and the server's
  or a client's state;
* :class:`Message` / :data:`Phase` / :data:`Replies` / :data:`RoundGenerator` - what a round's
  server generator and the clients exchange (engines only carry them); :func:`to_device` moves
  a message or a state, every tensor inside it, to a device;
* :class:`RoundContext` - what the server knows when a round starts;
* :class:`ClientRuntime` - what a client function may use (provided by an engine);
* :class:`ClientData`, :class:`Batch`, :class:`Forward` - a client's data and one step's tensors
  (:func:`normalize_uint8`: the one uint8-to-input normalisation);
* :class:`TrainSettings`, :class:`LocalResult` - what local training is asked and returns.

Server and client state are dicts of tensors and plain Python values, so checkpoints are
``torch.save`` of them and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

Arrays = dict[str, torch.Tensor]
State = dict[str, Any]


@dataclass
class Message:
    """One message between server and client.

    ``arrays`` holds named groups of tensors (``"model"``, ``"head"``, ``"anchors"``, ...); each
    group maps to one Flower ArrayRecord and is accounted separately in the communication
    ledger. ``scalars`` holds small values (sample counts, hyper-parameters, partner ids) that
    are not counted as payload.
    """

    kind: str
    arrays: dict[str, Arrays] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, tuple[int, int]]:
        """``{group: (floats, bytes)}`` of the tensors this message carries."""
        out = {}
        for group, arrays in self.arrays.items():
            numel = sum(t.numel() for t in arrays.values())
            nbytes = sum(t.numel() * t.element_size() for t in arrays.values())
            out[group] = (numel, nbytes)
        return out

    def with_model(self, model: Arrays) -> Message:
        """A copy of this message whose ``"model"`` group is ``model`` (the weights a client trains
        from when they are not the received ones), the other groups and scalars as they are."""
        return Message(self.kind, {**self.arrays, "model": model}, dict(self.scalars))


def to_device(obj: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor inside it (through messages, dicts, lists and tuples) on ``device``;
    anything else as it is. Nothing already there is copied, and a container whose contents are all
    already there is handed back itself (identity kept: on the CPU this is a no-op). Messages and
    client state cross between the engines' CPU side and a device-resident client through this
    one function. ``non_blocking``: the copies are only queued (from CUDA into pinned host memory),
    so the caller must synchronise the stream before reading them: one wait for a whole message
    instead of one per tensor."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Message):
        arrays, scalars = to_device(obj.arrays, device, non_blocking), to_device(obj.scalars, device, non_blocking)
        return obj if arrays is obj.arrays and scalars is obj.scalars else Message(obj.kind, arrays, scalars)
    if isinstance(obj, dict):
        moved = {k: to_device(v, device, non_blocking) for k, v in obj.items()}
        return obj if all(moved[k] is v for k, v in obj.items()) else moved
    if isinstance(obj, (list, tuple)):
        items = [to_device(v, device, non_blocking) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)     # a namedtuple takes fields
    return obj


Phase = dict[int, Message]
Replies = dict[int, Message]
RoundGenerator = Generator[Phase, Replies, State]


@dataclass(frozen=True)
class RoundContext:
    """What the server knows when a round starts."""

    round: int                      # 0-based round index
    clients: list[int]              # the clients sampled for this round, in sampling order
    num_clients: int                # K, all clients of the federation
    num_classes: int
    client_sizes: dict[int, int]    # training-set size of every client (known to the server in all five papers)
    rng: np.random.Generator        # the server's stream for this (seed, round)
    # True when the engine evaluates the clients' models after this round: methods whose
    # personalized models come from an adaptation step (Per-FedAvg, FedBABU's fine-tuning) add
    # that phase only then.
    evaluating: bool = False
    # Rounds the run is planned to last (None when unknown): FedFM-Lite uploads models in the last.
    num_rounds: int | None = None
    # The clients whose own models the evaluation after this round tests (``eval.clients``; empty
    # without personalized metrics); None when the engine does not say: then every client. Only
    # they need an adaptation phase (:meth:`evaluated_clients`).
    eval_clients: list[int] | None = None

    def evaluated_clients(self) -> list[int]:
        """The clients an evaluation-only phase of this round serves: ``eval_clients``, or all."""
        return list(range(self.num_clients)) if self.eval_clients is None else list(self.eval_clients)


@dataclass
class Batch:
    x: torch.Tensor          # normalised float inputs
    y: torch.Tensor          # int64 labels
    index: torch.Tensor      # positions of these samples in the client's training split
    extras: dict[str, Any] = field(default_factory=dict)   # what an augmentation adds (mixup partner labels, views)


@dataclass
class Forward:
    features: torch.Tensor   # body output h, (B, feature_dim)
    logits: torch.Tensor     # head output, (B, num_classes)


def normalize_uint8(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 images -> normalised float inputs; the one definition used by training and evaluation."""
    return (x.float().div_(255.0) - mean) / std


@dataclass
class ClientData:
    """A client's view of the shared in-memory pools: index tensors, no copies of images."""

    x: torch.Tensor                    # uint8 pool (N, C, H, W) shared by all clients
    y: torch.Tensor                    # int64 pool labels
    train_idx: torch.Tensor            # int64 indices into the pool
    mean: torch.Tensor                 # (1, C, 1, 1) normalisation
    std: torch.Tensor
    public: torch.Tensor | None = None  # uint8 unlabelled public images (data.public; KT-pFL), shared

    def inputs(self, idx: torch.Tensor) -> torch.Tensor:
        return normalize_uint8(self.x[idx], self.mean, self.std)

    def batch(self, positions: torch.Tensor) -> Batch:
        idx = self.train_idx[positions]
        return Batch(self.inputs(idx), self.y[idx], positions)

    def label_counts(self, num_classes: int) -> torch.Tensor:
        """(num_classes,) int64: how many of the client's training samples carry each label."""
        return torch.bincount(self.y[self.train_idx], minlength=num_classes)


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    drop_last: bool = False
    clip_grad_norm: float | None = None
    precision: str = "fp32"            # fp32 | bf16 (autocast; weights stay fp32)
    # The optimizer kernel (fedhet.training.optim): "sgd" (torch.optim.SGD's rule) or "adam".
    optimizer: str = "sgd"
    dampening: float = 0.0             # SGD
    nesterov: bool = False             # SGD
    betas: tuple[float, float] = (0.9, 0.999)   # Adam
    eps: float = 1e-8                  # Adam
    amsgrad: bool = False              # Adam
    # Optimizer state across rounds (train.optimizer_state): "reset" (a fresh optimizer every
    # round), "keep" (each client's state carried to its next round by the client host), "auto"
    # (the method's own default, Algorithm.keeps_optimizer_state).
    optimizer_state: str = "auto"
    # The layout convolutions train in (run.memory_format): "auto" is channels_last in bf16 and the
    # default layout in fp32; "contiguous" and "channels_last" choose it in either precision.
    memory_format: str = "auto"

    def __post_init__(self) -> None:
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(f"TrainSettings.memory_format: expected one of {', '.join(MEMORY_FORMATS)}, "
                             f"got {self.memory_format!r}")


MEMORY_FORMATS = ("auto", "contiguous", "channels_last")


def optimizer_state_kept(policy: str, method_keeps: bool) -> bool:
    """Whether clients' optimizer states persist across rounds under ``train.optimizer_state``
    ``policy``: "keep", or "auto" with a method that keeps them (``Algorithm.keeps_optimizer_state``,
    FedReMa's). The one reading of the policy: the client host acts on it, the config check
    refuses what it must not meet."""
    return policy == "keep" or (policy == "auto" and method_keeps)


@dataclass
class LocalResult:
    weights: Arrays                    # trained weights and buffers (detached copies)
    optimizer_state: Arrays            # optimizer buffers by parameter name (empty without momentum)
    steps: int
    samples: int                       # sample-steps processed (forward+backward)
    mean_loss: float
    loss_parts: dict[str, float] = field(default_factory=dict)
    # Totals of what the loss terms observed, batch by batch (LossTerm.statistics), keyed
    # "<term name>.<statistic>": FedCME's per-class feature sums, FedDistill's logit sums.
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)
    # The steps an entry was trained for where that is not ``steps``: training in phases over
    # different entries (FedRep's head, then its body) counts each entry's own phase here.
    entry_steps: dict[str, int] = field(default_factory=dict)


class ClientRuntime(Protocol):
    """What a client function may use: its id, data, a reusable model, settings and random streams.

    Provided by the engine; algorithm code relies on these members only.
    """

    cid: int
    round: int
    arch: str                        # architecture name of this client's model
    model: torch.nn.Module           # a reusable instance of that architecture (weights are passed in)
    buffer_names: list[str]          # names of its non-trainable buffers (BatchNorm statistics)
    num_classes: int
    num_samples: int                 # size of the client's training split
    data: ClientData
    settings: TrainSettings          # epochs, batch size, lr, momentum, ...
    # The augmentations this update's ``train`` calls were given, in call order (a method checks
    # that its own is among them: FedAvg's mixup).
    train_augmentations: list[Callable[..., Batch]]

    def train(self, weights: Arrays, terms: list[Any] | None = None, *, epochs: int | None = None,
              start_epoch: int = 0, trainable: Callable[[str], bool] | None = None,
              optimizer_state: Arrays | None = None, augment: Callable[..., Batch] | None = None,
              statistics: dict[str, torch.Tensor] | None = None, carry_optimizer_state: bool = True,
              data: ClientData | None = None, settings: TrainSettings | None = None,
              stream: str = "batches") -> LocalResult:
        """Local training from ``weights`` on ``terms`` (default: cross-entropy) with the run's
        settings; see :func:`fedhet.training.local.train_local` for the options.
        ``carry_optimizer_state=False``: a training apart from the client's own (FedBABU's
        fine-tune for evaluation, KT-pFL's distillation), which neither starts from nor updates
        the optimizer state a ``train.optimizer_state: keep`` run carries across rounds.
        ``data``, ``settings``: train on another data view (KT-pFL's public batch; default the
        client's own) with other settings (default the round's; ``epochs`` still overrides).
        ``stream``: the name of the random stream the batches are drawn from, so that a second
        training in the same round (on other data) draws from its own."""
        ...

    def account(self, result: LocalResult) -> None:
        """Count a result in the round's statistics (steps, samples, loss). ``train`` does this
        itself; a method with its own training loop (Per-FedAvg) calls it with the result it built."""
        ...

    def generator(self, *purpose: int | str) -> torch.Generator:
        """A random stream fixed by (run seed, round, client, purpose)."""
        ...

    def init_weights(self) -> Arrays:
        """Freshly initialised weights for this client's architecture (same for every client of that arch)."""
        ...
