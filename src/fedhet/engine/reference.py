"""The reference engine: one process, clients one after another, the obvious way.

It is the ground truth the faster engines and the Flower adapter are tested against. It owns
what an FL deployment spreads over machines: the server state, every client's persistent
state, one reusable model instance per architecture, and the communication ledger. It drives
an algorithm's round generator by delivering each phase's messages to the clients' functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fedhet.algorithms.base import (
    Algorithm,
    Arrays,
    ClientRuntime,
    Message,
    RoundContext,
    State,
)
from fedhet.algorithms.local import LocalResult, TrainSettings, train_local
from fedhet.algorithms.objective import CrossEntropy, LossTerm
from fedhet.data.federated import Federation
from fedhet.metrics.ledger import CommLedger
from fedhet.seeding import numpy_rng, torch_generator


@dataclass
class RoundStats:
    round: int
    clients: list[int]
    phases: int = 0
    train_seconds: float = 0.0
    aggregate_seconds: float = 0.0
    samples: int = 0                   # local sample-steps trained this round
    loss_sums: dict[int, float] = field(default_factory=dict)   # per client: sum of step losses over all phases
    steps: dict[int, int] = field(default_factory=dict)

    def mean_train_loss(self) -> float | None:
        total = sum(self.steps.values())
        return sum(self.loss_sums.values()) / total if total else None


class SimClient(ClientRuntime):
    """The runtime a client function sees inside the simulator."""

    def __init__(self, sim: "Simulator", cid: int, rnd: int, stats: RoundStats):
        self.sim = sim
        self.cid = cid
        self.round = rnd
        self.arch = sim.client_arch[cid]
        self.model = sim.models[self.arch]
        self.num_classes = sim.federation.num_classes
        self.data = sim.federation.client_data(cid)
        self.num_samples = len(self.data.train_idx)
        self.buffer_names = sim.buffer_names[self.arch]
        self.settings = sim.settings
        self._stats = stats

    def train(self, weights: Arrays, terms: list[LossTerm] | None = None, *, epochs: int | None = None,
              start_epoch: int = 0, trainable=None, optimizer_state: Arrays | None = None,
              augment=None, settings: TrainSettings | None = None) -> LocalResult:
        s = settings or self.settings
        if epochs is not None:
            s = TrainSettings(**{**s.__dict__, "epochs": epochs})
        result = train_local(
            self.model, weights, self.data, terms if terms is not None else [CrossEntropy()], s,
            lambda e: self.generator("batches", e), start_epoch=start_epoch, trainable=trainable,
            optimizer_state=optimizer_state, augment=augment,
            where=f"in round {self.round}, client {self.cid}, algorithm {self.sim.algorithm.name}",
        )
        self.account(result)
        return result

    def account(self, result: LocalResult) -> None:
        self._stats.samples += result.samples
        self._stats.loss_sums[self.cid] = self._stats.loss_sums.get(self.cid, 0.0) + result.mean_loss * result.steps
        self._stats.steps[self.cid] = self._stats.steps.get(self.cid, 0) + result.steps

    def generator(self, *purpose: int | str) -> torch.Generator:
        return torch_generator(self.sim.seed, "client", self.round, self.cid, *purpose)

    def init_weights(self) -> Arrays:
        return {k: v.clone() for k, v in self.sim.init_models[self.arch].items()}


class Simulator:
    def __init__(self, algorithm: Algorithm, federation: Federation, models: dict[str, torch.nn.Module],
                 client_arch: list[str], settings: TrainSettings, clients_per_round: int, seed: int):
        self.algorithm = algorithm
        self.federation = federation
        self.models = models
        self.client_arch = client_arch
        self.settings = settings
        self.clients_per_round = clients_per_round
        self.seed = seed
        self.buffer_names = {a: [n for n, _ in m.named_buffers()] for a, m in models.items()}
        # The models arrive freshly built from the run seed (see build_models); their weights are
        # the common initialisation of each architecture.
        self.init_models = {a: {k: v.detach().clone() for k, v in m.state_dict().items()} for a, m in models.items()}
        self.server_state: State = algorithm.init_server_state(
            {a: {k: v.clone() for k, v in w.items()} for a, w in self.init_models.items()})
        self.client_states: dict[int, State] = {}
        self.ledger = CommLedger()

    def sample_clients(self, rnd: int) -> list[int]:
        rng = numpy_rng(self.seed, "sample", rnd)
        k = self.federation.num_clients
        return [int(c) for c in rng.choice(k, size=self.clients_per_round, replace=False)]

    def round_context(self, rnd: int, evaluating: bool = False) -> RoundContext:
        return RoundContext(
            round=rnd, clients=self.sample_clients(rnd), num_clients=self.federation.num_clients,
            num_classes=self.federation.num_classes,
            client_sizes={c: len(t) for c, t in enumerate(self.federation.train_idx)},
            rng=numpy_rng(self.seed, "server", rnd), evaluating=evaluating)

    def deliver(self, cid: int, msg: Message, rnd: int, stats: RoundStats) -> Message:
        self.ledger.record(rnd, "down", msg)
        client = SimClient(self, cid, rnd, stats)
        reply, new_state = self.algorithm.client_update(msg, self.client_states.get(cid), client)
        if new_state is None:
            self.client_states.pop(cid, None)
        else:
            self.client_states[cid] = new_state
        self.ledger.record(rnd, "up", reply)
        return reply

    def run_round(self, rnd: int, evaluating: bool = False) -> RoundStats:
        ctx = self.round_context(rnd, evaluating)
        stats = RoundStats(rnd, ctx.clients)
        gen = self.algorithm.round(self.server_state, ctx)
        replies = None
        t_train = 0.0
        t0 = time.perf_counter()
        try:
            while True:
                phase = gen.send(replies)
                stats.phases += 1
                t1 = time.perf_counter()
                replies = self.deliver_phase(phase, rnd, stats)
                t_train += time.perf_counter() - t1
        except StopIteration as stop:
            new_state = stop.value
        if new_state is None:
            raise RuntimeError(f"{self.algorithm.name}.round() returned no server state")
        self.server_state = new_state
        stats.train_seconds = t_train
        stats.aggregate_seconds = time.perf_counter() - t0 - t_train
        return stats

    def deliver_phase(self, phase: dict[int, Message], rnd: int, stats: RoundStats) -> dict[int, Message]:
        """The replies of one phase's clients. Engines override this and nothing else of the round:
        workers (parallel), vmap (vectorized), Flower's Grid."""
        return {cid: self.deliver(cid, msg, rnd, stats) for cid, msg in phase.items()}

    # --- evaluation support -----------------------------------------------------------
    def client_model(self, cid: int) -> Arrays:
        weights = self.algorithm.client_model(cid, self.server_state, self.client_states.get(cid))
        return weights if weights is not None else self.init_models[self.client_arch[cid]]

    # --- checkpointing ----------------------------------------------------------------
    def snapshot(self) -> dict:
        return {"server_state": self.server_state, "client_states": self.client_states,
                "ledger": self.ledger.state_dict()}

    def restore(self, snap: dict) -> None:
        self.server_state = snap["server_state"]
        self.client_states = snap["client_states"]
        self.ledger.load_state_dict(snap["ledger"])
