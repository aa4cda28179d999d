"""The algorithm contract: what every federated method provides, independent of any engine.

A method is three things (docs/architecture.md has the diagram):

* ``round(state, ctx)`` - the server side of one round, written as a plain generator. It
  ``yield``s a :class:`Phase` (one :class:`Message` per client it wants to talk to) and is
  sent back the replies ``{client_id: Message}`` of the clients that answered. It may yield
  several phases (FedCME's mid-round classifier swap, FedFM's anchors-then-train) and finally
  ``return``s the new server state. Engines (the in-process simulator, Flower) only carry
  messages; they never look inside.
* ``client_update(msg, client_state, client)`` - the client side: a function of the message,
  the client's explicit persistent state and its data (reached through ``client``) that returns
  ``(reply, new_client_state)``. Nothing survives between calls except what is returned, so an
  engine can keep client state in memory, on disk or in a Flower node's ``context.state``.
* the local objective - a list of functional loss terms over parameter dicts
  (:mod:`fedhet.algorithms.objective`), trained by :func:`fedhet.algorithms.local.train_local`.

Server and client state are dicts of tensors and plain Python values, so checkpoints are
``torch.save`` of them and nothing else.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pydantic
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


class Algorithm:
    """Base class. Subclasses override the pieces that differ from FedAvg and nothing else.

    Class attributes:
      name: registry name used in configs.
      Params: a pydantic model of the method's hyper-parameters (``algorithm.params`` in a config).
      personalized: True when each client keeps its own model; selects the headline metric.
      has_global_model: False when there is no single model to test on the global test set.
    """

    name: ClassVar[str] = ""
    personalized: ClassVar[bool] = False
    has_global_model: ClassVar[bool] = True

    class Params(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")

    def __init__(self, params: pydantic.BaseModel | None = None):
        self.params = params if params is not None else self.Params()

    # --- server side -------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        """Initial server state from freshly initialised weights, one set per architecture."""
        raise NotImplementedError

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        raise NotImplementedError

    # --- client side -------------------------------------------------------------------
    def client_update(self, msg: Message, state: State | None, client: "ClientRuntime") -> tuple[Message, State | None]:
        raise NotImplementedError

    # --- evaluation --------------------------------------------------------------------
    def global_model(self, state: State) -> Arrays | None:
        """Weights of the global model (tested on the balanced test set), or None."""
        return None

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        """Weights with which client ``cid`` is evaluated on its own local test split.

        Default: the global model. Personalized methods return the client's own model; ``None``
        means the common initialisation of the client's architecture (a client never trained).
        Returning the *same object* for many clients lets the evaluator test them in one batch.
        """
        return self.global_model(state)

    def client_view(self, state: State, cid: int) -> State:
        """The part of the server state that ``client_model(cid, ...)`` reads. A distributed engine
        sends this (not the whole state) to the node that evaluates client ``cid``; methods that
        keep every client's personal part on the server (FedReMa's and FedPAC's heads) return
        only that client's."""
        return state

    def round_metrics(self, state: State) -> dict[str, Any]:
        """Method-specific values to record each round (FedReMa's CCP flag, FedCME's pairs)."""
        return {}


class ClientRuntime:
    """What a client function may use: its id, data, a reusable model, settings and random streams.

    Provided by the engine (:class:`fedhet.engine.reference.SimClient` in the simulator); algorithm
    code relies on these members only.
    """

    cid: int
    round: int
    arch: str                        # architecture name of this client's model
    model: torch.nn.Module           # a reusable instance of that architecture (weights are passed in)
    buffer_names: list[str]          # names of its non-trainable buffers (BatchNorm statistics)
    num_classes: int
    num_samples: int                 # size of the client's training split
    data: Any                        # fedhet.algorithms.local.ClientData
    settings: Any                    # fedhet.algorithms.local.TrainSettings: epochs, batch size, lr, momentum, ...

    def train(self, weights: Arrays, terms=None, *, epochs: int | None = None, start_epoch: int = 0,
              trainable=None, optimizer_state: Arrays | None = None, augment=None):
        """Local SGD from ``weights`` on ``terms`` (default: cross-entropy) with the run's settings;
        returns a :class:`fedhet.algorithms.local.LocalResult`. See ``train_local`` for the options."""
        raise NotImplementedError

    def account(self, result) -> None:
        """Count a :class:`fedhet.algorithms.local.LocalResult` in the round's statistics (steps,
        samples, loss). ``train`` does this itself; a method with its own training loop (Per-FedAvg)
        calls it with the result it built."""
        raise NotImplementedError

    def generator(self, *purpose: int | str) -> torch.Generator:
        """A random stream fixed by (run seed, round, client, purpose)."""
        raise NotImplementedError

    def init_weights(self) -> Arrays:
        """Freshly initialised weights for this client's architecture (same for every client of that arch)."""
        raise NotImplementedError
