"""FedBABU (Oh, Kim & Yun, ICLR 2022): federated training of the body only, fine-tuning for personalization.

During federated training the head (classifier, ``model.split``) stays at its random
initialisation: clients train the body with the head frozen ("the head is randomly initialized
and never updated", paper abstract and Algorithm 1) and the server averages the bodies. The
personalized model of a client is the global model fine-tuned on that client's training data
(the paper's personalized evaluation by fine-tuning; official code ``--ft_ep``; PFLlib
``clientbabu.fine_tune``).

Delta from FedAvg:

* ``train_options``: ``trainable`` rejects head parameters, so they never change bitwise.
* Messages carry the shared part only (array group ``"model"`` = every tensor except the head
  parameters: the body and any buffers). The head is the common initialisation of the
  architecture, which every client gets from ``client.init_weights()`` (the same tensors the
  server was initialised with), so it is never sent (PFLlib's ``set_parameters`` likewise only
  loads the base, and the server aggregates ``model.base``).
* ``aggregate``: FedAvg of the shared part; the head parameters of the server state are kept as
  they are (bitwise the initialisation; averaging identical copies would not be bitwise exact).
* Personalized evaluation: only when the engine evaluates after this round
  (``RoundContext.evaluating``) the server adds a phase that sends the new shared part to the
  clients the evaluation tests (``RoundContext.eval_clients``: all of them under ``eval.clients:
  all``, none without personalized metrics; group ``"eval_model"``, so the ledger shows this
  evaluation-only traffic apart and leaves it out of its up and down totals).
  Each client fine-tunes ``finetune_epochs`` epochs of SGD with the run's lr, momentum, batch
  size and a fresh optimizer, on its training data, updating ``finetune_part``: ``full``
  (default: the paper's and PFLlib's ``fine_tune(['base', 'head'])``), ``head`` or ``body``.
  It runs through ``client.train`` (so a vectorized engine fine-tunes all clients at once) with
  epochs numbered after the round's E training epochs (``start_epoch = E``), which gives it a
  batch order of its own. The client keeps the result in its client state
  (``fedbabu_finetuned``) and replies with its sample count only; :meth:`client_model` returns
  it. Fine-tuning never reaches the server, and the next training starts from the received
  global model (the stored fine-tuned model is dropped then). Being client compute, it is
  counted in the round's statistics: ``samples`` and ``train_loss`` of an evaluated round include
  the fine-tuning steps of the evaluated clients.

Defaults and where the references disagree:

* ``finetune_epochs = 5``: the official code's ``--ft_ep`` default (jhoon-oh/FedBABU
  ``utils/options.py``); PFLlib's ``--fine_tuning_epochs`` default is 10.
* Fine-tuning lr and momentum: the run's (``finetune_lr`` and ``finetune_momentum`` None), as
  PFLlib (FedReMa's code base). The official code's personalized evaluation (``analysis.ipynb``)
  fine-tunes at lr 1e-3 with momentum 0.9 where its scripts train at lr 0.1:
  ``finetune_lr: 0.001, finetune_momentum: 0.9`` for that.
* When: PFLlib fine-tunes once, after the last round, and reports the global model (random
  head) in every earlier evaluation; fedhet fine-tunes at every evaluation, from the current
  global model, so every evaluated round reports the personalized accuracy.
* Head: the paper's head is the last linear layer; PFLlib's FedAvgCNN head is ``fc`` (the last
  Linear, cnn2 split ``fc2``). The split is the config's ``model.split``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field
from torch import nn

from fedhet.algorithms.aggregate import check_buffers_known_to_server, server_trainable
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import (
    Arrays,
    ClientRuntime,
    Message,
    Replies,
    RoundContext,
    RoundGenerator,
    State,
)
from fedhet.core.split import HEAD, is_body, is_head

FINETUNED = "fedbabu_finetuned"      # client-state key of the fine-tuned (personalized) model


def head_parameter_names(weights: Arrays) -> set[str]:
    """The frozen tensors: head parameters (floating, not BatchNorm statistics)."""
    return {k for k in server_trainable(weights) if k.startswith(HEAD)}


def shared_part(weights: Arrays) -> Arrays:
    """Everything but the head parameters: what FedBABU sends and averages."""
    frozen = head_parameter_names(weights)
    return {k: v for k, v in weights.items() if k not in frozen}



class FedBABU(FedAvg):
    """FedBABU; see the module docstring for the frozen head, aggregation and fine-tuning."""

    name = "fedbabu"
    evaluates_own_model = True         # client_model: its fine-tuned model as it is
    clients_own_head = True            # every client rebuilds the initial head itself
    uploads_no_head = True
    personalized = True
    only_body_and_head = True          # own entries beside the network are neither

    class Params(FedAvg.Params):
        finetune_epochs: int = Field(5, ge=0)        # official code ft_ep = 5 (PFLlib: 10)
        finetune_part: Literal["full", "head", "body"] = "full"
        finetune_lr: float | None = Field(None, gt=0)                 # None: the run's lr (PFLlib); official 1e-3
        finetune_momentum: float | None = Field(None, ge=0, lt=1)     # None: the run's (PFLlib); official 0.9

    def check_model(self, arch: str, model: nn.Module) -> None:
        super().check_model(arch, model)
        check_buffers_known_to_server(self.name, arch, model, "its head freezing (frozen, never sent)", prefix=HEAD)

    # --- server ---------------------------------------------------------------------------
    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        state = yield from super().round(state, ctx)
        if ctx.evaluating and self.params.finetune_epochs > 0:
            shared = shared_part(state["model"])
            if chosen := ctx.evaluated_clients():      # the clients the evaluation tests
                yield {cid: Message("finetune", {"eval_model": shared}) for cid in chosen}
        return state

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = super().train_message(state, cid, ctx)
        msg.arrays["model"] = shared_part(msg.arrays["model"])
        return msg

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        old = state["model"]
        state = super().aggregate(state, replies, ctx)          # averages the uploaded shared parts
        new = state["model"]
        state["model"] = {k: new.get(k, old[k]) for k in old}   # head parameters: kept bitwise
        return state

    # --- client ---------------------------------------------------------------------------
    def complete(self, shared: Arrays, client: ClientRuntime) -> Arrays:
        """The full model: received shared part + the common (initial) head parameters."""
        init = client.init_weights()
        head = {k: init[k] for k in head_parameter_names(init)}
        return {k: shared[k] if k in shared else head[k] for k in init}

    def train_options(self, msg: Message, state: State | None, client: ClientRuntime):
        options = super().train_options(msg, state, client)
        previous = options.get("trainable")
        if previous is None:
            options["trainable"] = is_body
        else:
            options["trainable"] = lambda name: is_body(name) and previous(name)
        return options

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        base = {k: v for k, v in (state or {}).items() if k != FINETUNED} or None
        if msg.kind == "finetune":
            return self.finetune(msg, base, client)
        if "model" in msg.arrays:            # the shared part: completed with the common head
            msg = msg.with_model(self.complete(msg.arrays["model"], client))
        reply, new_state = super().client_update(msg, base, client)
        # the upload trimmed here, not in uploaded_model: a component's own client_update (Per-FedAvg's) is
        # trimmed too; another component's phase may upload no model (FedFM's anchors, FedCME's exchange)
        if "model" in reply.arrays:
            reply.arrays["model"] = shared_part(reply.arrays["model"])
        return reply, new_state

    def local_model(self, uploaded: Arrays, init: Arrays) -> Arrays:
        """The uploaded shared part with the common initial head (frozen in training)."""
        head = head_parameter_names(init)
        return {**{k: init[k] for k in head}, **super().local_model(uploaded, init)}

    def finetune(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        """``finetune_epochs`` epochs of SGD on ``finetune_part`` from the global model (evaluation only)."""
        weights = self.with_local_buffers(self.complete(msg.arrays["eval_model"], client), state, client)
        part = self.params.finetune_part
        trainable = {"full": None, "head": is_head, "body": is_body}[part]
        p, settings = self.params, client.settings
        if p.finetune_lr is not None or p.finetune_momentum is not None:
            settings = replace(settings, lr=settings.lr if p.finetune_lr is None else p.finetune_lr,
                               momentum=settings.momentum if p.finetune_momentum is None else p.finetune_momentum)
        # Epochs numbered after the round's E training epochs: a batch order of their own.
        result = client.train(weights, self.data_terms(msg, state, client), epochs=p.finetune_epochs,
                              start_epoch=client.settings.epochs, trainable=trainable, settings=settings,
                              carry_optimizer_state=False)
        return Message("finetuned", scalars={"num_samples": client.num_samples}), {**(state or {}), FINETUNED: result.weights}

    # --- evaluation -----------------------------------------------------------------------
    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        if client_state and FINETUNED in client_state:
            return client_state[FINETUNED]
        return super().client_model(cid, state, client_state)
