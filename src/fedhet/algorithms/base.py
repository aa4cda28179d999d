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
  (:mod:`fedhet.training.objective`), trained by :func:`fedhet.training.local.train_local`.

Server and client state are dicts of tensors and plain Python values, so checkpoints are
``torch.save`` of them and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import pydantic
from torch import nn

from fedhet.core.contract import (
    Arrays,
    ClientData,
    ClientRuntime,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    RoundGenerator,
    State,
    TrainSettings,
)
from fedhet.core.settings import refuse_quiet_values


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
    # Whether, under train.optimizer_state "auto", each client's optimizer state is kept across
    # rounds (by the client host; the method itself does nothing). FedReMa's reference does.
    keeps_optimizer_state: ClassVar[bool] = False
    # Whether the method's server rule is derived for local SGD (SCAFFOLD's control variates,
    # FedNova's normalisation): the run is refused with train.optimizer adam.
    requires_sgd: ClassVar[bool] = False
    # Whether the method's phases act on the network's body and head by their names (FedPer's,
    # FedRep's and FedBABU's), so that entries of a method's own beside the network (see
    # fedhet.training.local.trained_names) are neither of the two and are left out. A method
    # with such entries refuses to be combined with one that sets this.
    only_body_and_head: ClassVar[bool] = False

    class Params(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")

        @pydantic.model_validator(mode="before")
        @classmethod
        def _no_quiet_values(cls, data: Any) -> Any:
            return refuse_quiet_values(cls.model_fields, data)      # `mu: true`, `mu: .inf`

    def __init__(self, params: pydantic.BaseModel | None = None):
        self.params = params if params is not None else self.Params()

    # --- set-up ------------------------------------------------------------------------
    def check_data(self, data: ClientData) -> None:
        """Raise a ConfigError when the run's data cannot serve this method. ``build`` calls it
        once with client 0's view of the shared pools (data.public included), before any training,
        so that a bad setting stops the run before anything is computed."""

    def check_round_size(self, clients_per_round: int) -> None:
        """Raise a ConfigError when the method's mechanism cannot act with this many clients a round
        (FedCME's classifier exchange needs a partner). Default: any number."""

    def check_schedule(self, rounds: int, local_epochs: int) -> None:
        """Raise a ConfigError when the run's rounds or local epochs leave a part of this method
        with nothing to do (so that the run would be another method under this one's name).
        ``make_algorithm`` calls it before anything is built."""

    def check_model(self, arch: str, model: nn.Module) -> None:
        """Raise a ConfigError when architecture ``arch``, as this run builds it (``model.split`` and
        ``model.options`` applied), cannot serve this method, e.g. FedRS's, FedROD's, FedNH's, CReFF's
        and FedProto's classifier must be one Linear map of the features. The client host
        (``engine.host.ClientHost``) calls it once per architecture of the federation when it is
        made, before any training, and ``fedhet flower run`` before it starts any node (a method of
        one's own can refuse a model the same way); it must not change the model. Default: any model."""

    def settings_not_applied(self, settings: TrainSettings) -> dict[str, str]:
        """The run's training settings this method's local training leaves out, each with why
        (Per-FedAvg's meta steps are plain SGD: no momentum). The run warns of them when it starts
        and records them in ``summary.json`` (``settings_not_applied``), so that no setting is
        dropped without a word. ``settings`` are the first round's. Call ``super()`` and add yours
        with :func:`add_reasons` (``fedhet.extend.add_reasons``), so that a combination names every
        component's. Default: none."""
        return {}

    # --- server side -------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        """Initial server state from freshly initialised weights, one set per architecture."""
        raise NotImplementedError

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        """One phase, FedAvg's: every sampled client gets its ``train_message``, and ``aggregate``
        makes the new state from the replies. Methods with more phases (FedCME's exchange, FedFM's
        anchors) or none of these two hooks (Local-only) override it."""
        replies = yield {cid: self.train_message(state, cid, ctx) for cid in ctx.clients}
        return self.aggregate(dict(state), replies, ctx)

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        """What client ``cid`` receives to train this round."""
        raise NotImplementedError

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        """The new server state from the replies of the clients that answered."""
        raise NotImplementedError

    # --- client side -------------------------------------------------------------------
    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
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

    def client_model_reads_state(self) -> bool:
        """Whether :meth:`client_model` reads its ``client_state``. When False the evaluator passes
        None and does not load the client's state (a store may keep it on disk: one file a client
        an evaluation). True for any method with a ``client_model`` of its own; one that reads no
        state there may say so by overriding this too."""
        return type(self).client_model is not Algorithm.client_model

    def extension_problem(self, done_rounds: int, rounds: int) -> str | None:
        """Why a run that ended after ``done_rounds`` rounds, extended to ``rounds``, would not
        compute what a run of ``rounds`` rounds does (its last round acted as the last, e.g. an
        upload made only then), or None. A resume that raises train.rounds refuses the run then."""
        return None

    def client_view(self, state: State, cid: int) -> State:
        """The part of the server state that ``client_model(cid, ...)`` reads. A distributed engine
        sends this (not the whole state) to the node that evaluates client ``cid``; methods that
        keep every client's personal part on the server (FedReMa's and FedPAC's heads) return
        only that client's."""
        return state

    def round_metrics(self, state: State) -> dict[str, Any]:
        """Method-specific values to record each round (FedReMa's CCP flag, FedCME's pairs), named
        apart from fedhet's own metrics (``global_*``, ``personal_*``, ``local_*``, ``feature_*`` and a
        row's fixed keys: such a name stops the run). Values: numbers, strings, None, tensors and
        NumPy values (recorded as Python numbers and lists), and lists and dicts of them. Call
        ``super()`` and add yours, so that a combination records every component's."""
        return {}


def add_reasons(reasons: dict[str, str], keys: Iterable[str], why: str) -> dict[str, str]:
    """``reasons`` (``settings_not_applied``'s) with ``why`` added to each of ``keys``, after any
    reason a combined method gave already."""
    out = dict(reasons)
    for key in keys:
        out[key] = f"{out[key]}; {why}" if key in out else why
    return out


def update_reply(result: LocalResult, client: ClientRuntime, arrays: dict[str, Arrays], /,
                 **scalars: Any) -> Message:
    """The ``"update"`` a client sends after its round's local training: ``arrays`` (its model,
    or what the method uploads instead), with its training-set size (FedAvg's aggregation weight)
    and the training's step count and mean loss. ``scalars`` are added after those (FedACD's
    score) or replace them (FedCME's totals over its two training calls)."""
    return Message("update", arrays, {"num_samples": client.num_samples, "steps": result.steps,
                                      "loss": result.mean_loss, **scalars})
