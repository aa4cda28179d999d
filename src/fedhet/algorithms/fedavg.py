"""FedAvg (McMahan et al., 2017): sample-size weighted averaging of locally trained models.

Every other generic method in fedhet is a delta from this class, made by overriding hooks:

  server:  ``train_message`` (what each client receives), ``aggregate`` (the server rule),
           ``aggregation_weights`` (each reply's weight in the average), ``average_models``
           (how the weighted average of the uploads is taken), or ``round`` itself for extra
           phases;
  client:  ``start_weights`` (what training starts from), ``local_training`` (how the round's
           epochs run), ``data_terms`` (the supervised term, cross-entropy by default),
           ``local_terms`` (regularisers added to it), ``train_options`` (frozen parameters,
           kept optimizer state, augmentation), ``after_training`` (new client state),
           ``uploaded_model`` (what of the model is sent back), ``uploads`` (extra tensors sent
           back), ``upload_scalars`` (extra numbers);
  evaluation: ``local_model`` (the whole trained model an upload stands for, which
           ``eval.local_risk`` judges).

Hooks call ``super()`` so methods compose by multiple inheritance (``fedprox+scaffold``: see
:func:`fedhet.algorithms.compose`). A method that wraps ``client_update`` acts on ``"train"``
messages only and passes other kinds through, so a component's extra phase (FedFM's anchors)
reaches its owner untouched.

Input Mixup (``mixup``, Zhang et al. 2018; off by default, on for FedACD): every local batch is
blended with a shuffled copy of itself, ``lam x_a + (1 - lam) x_b`` with ``lam ~ Beta(mixup_alpha,
mixup_alpha)`` per batch, and the loss weighs both labels by ``lam``. The FedACD paper's Table 5 runs
FedAvg, FedROD, FedLC and FedNH with it. ``augment`` trains on augmented images instead
(``crop_flip_rotate``: FedFM's CIFAR-100 pipeline; ``supcon_view``: one view of FedClassAvg's),
one augmentation a batch, so not with mixup. Either reaches local training through
``train_options``; a method that trains without them, or with a loss term that reads only the
first label under mixup, is refused rather than run on clean images.

BatchNorm statistics (policy ``bn_buffers``):
  * ``average`` (default) - running mean/var are averaged like weights, so the global model
    carries population statistics and evaluates correctly on the global test set;
  * ``local`` - each client keeps its own running statistics across rounds (FedBN-style) and
    trains/evaluates with them; the server still averages the uploaded copies so that the
    global model has statistics to evaluate with.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.base import Algorithm, update_reply
from fedhet.core.contract import (
    Arrays,
    ClientRuntime,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.core.errors import ConfigError
from fedhet.training.augment import BaselineAugmentation, Mixup, baseline_augmentation
from fedhet.training.objective import CrossEntropy, LossTerm


class FedAvg(Algorithm):
    name = "fedavg"
    # True for a method whose local training builds its data term itself (FedACD, per epoch), so
    # that ``compose`` refuses a partner that replaces ``data_terms`` instead of ignoring it.
    builds_own_data_term: ClassVar[bool] = False
    # False for a method that cannot train with ``mixup``: a loss term of its own reads the labels as
    # they are (FedProto's prototype alignment, FedFM's anchor matching, ...), or its training takes no
    # augmentation (Per-FedAvg's meta-steps). It is refused when the method is made, not rounds later
    # when such a term first appears.
    takes_mixup: ClassVar[bool] = True
    # False for a method whose local steps take no augmentation at all (Per-FedAvg's meta-steps):
    # ``augment`` is refused when the method is made.
    takes_augment: ClassVar[bool] = True
    # False for a method whose clients receive no global model (FedProto: prototypes only) ...
    sends_global_model: ClassVar[bool] = True
    # ... which combines only with methods that read none (their loss terms need the client's own
    # data and model only: FedLC, FedRS, FedDecorr).
    reads_no_global_model: ClassVar[bool] = False
    # True for a method whose local training runs over two messages (FedCME: before and after its
    # classifier exchange) ...
    trains_over_two_messages: ClassVar[bool] = False
    # ... and for one whose client rule reads the training of one message (SCAFFOLD's control
    # variate, FedNova's a_i, both from that message's steps and drift): the two cannot combine.
    reads_one_messages_training: ClassVar[bool] = False
    # True for a method whose server state must take every round's uploads (SCAFFOLD's control
    # deltas): FedFM-Lite, which aggregates only in the rounds whose models come up, refuses it
    # with model_every > 1 (a check on a parameter, so made when FedFM-Lite is made).
    aggregates_every_round: ClassVar[bool] = False
    # True for a method whose client_model returns, for an evaluated client, a model of its own
    # making (Per-FedAvg's adapted model, FedBABU's fine-tuned one) without calling super(): a
    # method named after it whose client_model changes the model (FedROD's personal head) must be
    # named first.
    evaluates_own_model: ClassVar[bool] = False
    # The head (``model.split`` on) in a combination, which ``compose`` checks:
    # True for a method whose clients train against the head the server keeps (FedNH's prototypes) ...
    trains_on_server_head: ClassVar[bool] = False
    # ... and for one whose clients train with a head of their own (FedPer's and FedRep's personal
    # heads, FedPAC's combined ones, FedBABU's initial one): the two cannot combine.
    clients_own_head: ClassVar[bool] = False
    # True for a method whose clients upload no head, their server putting one back after the
    # average (FedNH's prototypes, FedBABU's initial head) ...
    uploads_no_head: ClassVar[bool] = False
    # ... and for one whose aggregate reads the averaged model's head (CReFF's re-trained classifier),
    # which must then be named before such a method, so that the head is back when it reads it.
    reads_averaged_head: ClassVar[bool] = False

    class Params(Algorithm.Params):
        bn_buffers: Literal["average", "local"] = "average"
        mixup: bool = False                               # Input Mixup on every local batch
        mixup_alpha: float = Field(1.0, gt=0)             # lam ~ Beta(alpha, alpha)
        # the images of every local batch: clean, one view of FedClassAvg's pipeline, or the CIFAR
        # crop, flip and rotation of FedFM's code (fedhet.training.augment)
        augment: BaselineAugmentation = "none"

    def __init__(self, params: Any = None):
        super().__init__(params)
        if self.params.mixup and not self.takes_mixup:
            raise ConfigError(f"algorithm.params.mixup: {self.name} cannot train with mixup (a loss term of its own "
                              "reads the labels as they are, or its local steps take no augmentation); turn mixup "
                              "off for it")
        if self.params.augment != "none" and not self.takes_augment:
            raise ConfigError(f"algorithm.params.augment: {self.name}'s local steps take no augmentation; leave "
                              f"augment at none for it")
        if self.params.augment != "none" and self.params.mixup:
            raise ConfigError(f"algorithm.params: mixup and augment {self.params.augment} each take a local batch's "
                              "one augmentation; choose one")

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        if len(init_models) != 1:
            raise ValueError(f"{self.name} averages whole models, so every client needs the same architecture; "
                             f"got {sorted(init_models)}")
        (weights,) = init_models.values()
        return {"model": weights}

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        return Message("train", {"model": state["model"]})

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        cids = sorted(replies)  # a fixed order keeps float sums identical across engines
        state["model"] = self.average_models(state.get("model"), replies, cids)
        return state

    def average_models(self, model: Arrays | None, replies: Replies, cids: list[int]) -> Arrays:
        """The round's average of the uploaded models, from which the server rules of a composition
        go on (FedAvgM's momentum, FedDyn's correction, SCAFFOLD's server step): the weighted mean
        here, FedNova's normalised average there. ``model``: the global model the round started
        from (None in a state without one: the mean needs none)."""
        return weighted_average([replies[c].arrays["model"] for c in cids], self.aggregation_weights(replies, cids))

    def aggregation_weights(self, replies: Replies, cids: list[int]) -> list[float]:
        """Each answering client's weight in the average: its training-set size (FedACD: its score).
        FedNova's normalised averaging weights by the same hook, so a composition agrees on it."""
        return [float(replies[c].scalars["num_samples"]) for c in cids]

    # --- client ---------------------------------------------------------------------------
    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        start = self.start_weights(msg, state, client)
        if start is not msg.arrays["model"]:
            # the hooks below (local terms of a combined method, uploads) see the model training starts from
            msg = msg.with_model(start)
        weights = self.with_local_buffers(start, state, client)
        result = self.local_training(weights, msg, state, client)
        self.refuse_training_without_mixup(result, client)
        state = self.after_training(result, msg, state, client)
        reply = update_reply(result, client, {"model": self.uploaded_model(result.weights),
                                              **self.uploads(result, msg, state, client)},
                             **self.upload_scalars(result, msg, state, client))
        return reply, state

    def local_step(self, client: ClientRuntime) -> tuple[float, float]:
        """The (step size, momentum) of this method's local steps, which the server rules derived for
        local SGD read (SCAFFOLD's option II, FedNova's a_i): the run's; Per-FedAvg's meta-steps take
        ``perfedavg_beta`` and no momentum."""
        return client.settings.lr, client.settings.momentum

    def start_weights(self, msg: Message, state: State | None, client: ClientRuntime) -> Arrays:
        """The weights local training starts from: the received model (FedPer: the received body
        with the client's own head)."""
        return msg.arrays["model"]

    def uploaded_model(self, weights: Arrays) -> Arrays:
        """What of the trained model goes back as ``"model"``: all of it (FedPer: the body)."""
        return weights

    def local_model(self, uploaded: Arrays, init: Arrays) -> Arrays:
        """The whole trained model an uploaded ``"model"`` stands for, given the initial weights
        ``init``: what ``eval.local_risk`` judges. The upload itself (FedBABU: with the initial head
        its clients never train); a part that is still missing refuses ``eval.local_risk``."""
        return uploaded

    def refuse_training_without_mixup(self, result: LocalResult, client: ClientRuntime) -> None:
        """Raise when ``mixup`` or ``augment`` is on but the local training just run never passed
        ``train_options`` to ``client.train`` (a method of one's own that builds its own call): it would
        have trained on clean images. A ``client_update`` of one's own calls this after its local training."""
        if not result.steps:
            return
        if self.params.mixup and not any(isinstance(a, Mixup) for a in client.train_augmentations):
            raise ConfigError(f"algorithm.params.mixup: {self.name}'s local training does not pass its train_options "
                             "to client.train, so it would run without mixup; turn mixup off for this method")
        if self.params.augment != "none" and not client.train_augmentations:
            raise ConfigError(f"algorithm.params.augment: {self.name}'s local training does not pass its "
                              "train_options to client.train, so it would run on clean images; leave augment at "
                              "none for this method")

    def local_training(self, weights: Arrays, msg: Message, state: State | None, client: ClientRuntime) -> LocalResult:
        """One round's local training: E epochs of SGD on all parameters (FedRep, FedPAC and
        FedReMa+A&F alternate head and body instead)."""
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        return client.train(weights, terms, **self.train_options(msg, state, client))

    def data_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        """The supervised term; methods that change the softmax itself (FedRS, FedACD) replace it."""
        return [CrossEntropy()]

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        """Regularisers added to the data term (FedProx, MOON, FedCME's alignment, ...)."""
        return []

    def proximal_pull(self) -> float:
        """The summed mu of the ``(mu/2) ||w - w_received||^2`` terms among ``local_terms`` (FedProx's
        mu, FedDyn's alpha): each local step is pulled back towards the start by lr * mu, which
        FedNova's a_i counts. A method adding such a term adds its mu to ``super()``'s."""
        return 0.0

    def train_options(self, msg: Message, state: State | None, client: ClientRuntime) -> dict[str, Any]:
        """Keyword arguments of ``client.train``: here the batch augmentation, mixup's or ``augment``'s."""
        if self.params.mixup:
            return {"augment": Mixup(self.params.mixup_alpha)}
        if self.params.augment != "none":
            return {"augment": baseline_augmentation(self.params.augment, client.data)}
        return {}

    def after_training(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> State | None:
        return self.keep_local_buffers(result.weights, state, client)

    def uploads(self, result: LocalResult, msg: Message, state: State | None, client: ClientRuntime) -> dict[str, Arrays]:
        return {}

    def upload_scalars(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> dict[str, Any]:
        """Small values sent back beside the model (FedACD's aggregation score)."""
        return {}

    # --- BatchNorm policy -----------------------------------------------------------------
    def with_local_buffers(self, weights: Arrays, state: State | None, client: ClientRuntime) -> Arrays:
        if self.params.bn_buffers == "local" and state and "buffers" in state:
            weights = {**weights, **state["buffers"]}
        return weights

    def keep_local_buffers(self, weights: Arrays, state: State | None, client: ClientRuntime) -> State | None:
        if self.params.bn_buffers != "local":
            return state
        buffers = {k: weights[k] for k in client.buffer_names}
        return {**(state or {}), "buffers": buffers} if buffers else state

    # --- evaluation -----------------------------------------------------------------------
    def global_model(self, state: State) -> Arrays | None:
        return state["model"]

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        """The global model (``global_model``: CReFF's re-trained one), with the client's own
        BatchNorm statistics under ``bn_buffers: local``."""
        model = self.global_model(state)
        if model is not None and self.params.bn_buffers == "local" and client_state and "buffers" in client_state:
            return {**model, **client_state["buffers"]}
        return model

    def client_model_reads_state(self) -> bool:
        # this client_model reads only the local BatchNorm statistics; SCAFFOLD's c_i, MOON's previous
        # model... stay where the store keeps them. A method's own client_model may read anything.
        if type(self).client_model is not FedAvg.client_model:
            return True
        return self.params.bn_buffers == "local"
