"""The one round loop: server state, client states, communication ledger and random streams.

:class:`RoundLoop` drives an algorithm's round generator. For each phase it records the
downlink, hands the phase's jobs (message, client state, the client's round tally) to a
:class:`Transport`, and applies what comes back - replies, new client states, tallies, uplink -
in the phase's order, which is what makes every transport's results equal the reference's.
Transports only deliver: in this process (:class:`InProcess`, the reference), forked workers
(:mod:`fedhet.engine.parallel`), ``vmap`` (:mod:`fedhet.engine.vectorized`), Flower's Grid
(:mod:`fedhet.flower.engine`). A client missing from a transport's answer dropped out of the
phase; the generator gets the replies of the clients that answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedhet.core.contract import Arrays, Message, Phase, Replies, RoundContext, State, to_device
from fedhet.core.seeding import numpy_rng
from fedhet.engine.client_store import ClientStates
from fedhet.engine.host import ClientHost, Job, JobResult, Tally
from fedhet.engine.ledger import CommLedger


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

    def tally(self, cid: int) -> Tally:
        return Tally(0, self.loss_sums.get(cid), self.steps.get(cid, 0))

    def apply(self, cid: int, before: Tally, after: Tally) -> None:
        self.samples += after.samples - before.samples
        if after.loss_sum is not None:
            self.loss_sums[cid] = after.loss_sum
            self.steps[cid] = after.steps


class Transport:
    """Delivers one phase's jobs and returns the results of the clients that answered.

    Subclasses implement :meth:`deliver`; the loop calls :meth:`attach` once with the host whose
    clients they run, and :meth:`close` at the end of a run."""

    name = "transport"
    # True when client state lives where the clients run (Flower nodes): the loop then neither
    # sends nor stores it.
    keeps_client_state = False
    host: ClientHost

    def attach(self, host: ClientHost) -> None:
        self.host = host

    def deliver(self, rnd: int, jobs: list[Job]) -> dict[int, JobResult]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds (worker processes, device copies)."""

    def info(self) -> dict[str, Any]:
        """What summary.json records as the run's engine."""
        return {"engine": self.name, "workers": 1}

    def training_layout(self, channels_last: bool) -> tuple[str, int]:
        """The layout local training's convolutions ran in, given whether the run's settings ask
        for channels_last (``run.memory_format`` resolved), and how many training calls ran in the
        other one: the clients train as the settings say (the vectorized engine differs)."""
        return ("channels_last" if channels_last else "contiguous"), 0


class InProcess(Transport):
    """The reference transport: every job in this process, one after another."""

    name = "reference"

    def deliver(self, rnd: int, jobs: list[Job]) -> dict[int, JobResult]:
        return {job.cid: self.host.run(rnd, job) for job in jobs}


class RoundLoop:
    """Rounds of one algorithm over one federation, carried by ``transport`` (default in-process)."""

    def __init__(self, host: ClientHost, clients_per_round: int, transport: Transport | None = None,
                 client_states: ClientStates | None = None):
        """``client_states``: the store of the clients' persistent states (engine/client_store.py);
        default: all in memory."""
        self.host = host
        self.algorithm = host.algorithm
        self.federation = host.federation
        self.clients_per_round = clients_per_round
        self.seed = host.seed
        self.transport: Transport = transport if transport is not None else InProcess()
        self.transport.attach(host)
        self.server_state: State = self.algorithm.init_server_state(
            {a: {k: v.clone() for k, v in w.items()} for a, w in host.init_models.items()})
        self.client_states: ClientStates = client_states if client_states is not None else ClientStates()
        self.ledger = CommLedger()

    def sample_clients(self, rnd: int) -> list[int]:
        rng = numpy_rng(self.seed, "sample", rnd)
        k = self.federation.num_clients
        return [int(c) for c in rng.choice(k, size=self.clients_per_round, replace=False)]

    def round_context(self, rnd: int, evaluating: bool = False, num_rounds: int | None = None,
                      eval_clients: list[int] | None = None) -> RoundContext:
        return RoundContext(
            round=rnd, clients=self.sample_clients(rnd), num_clients=self.federation.num_clients,
            num_classes=self.federation.num_classes,
            client_sizes=self.federation.client_sizes(),
            rng=numpy_rng(self.seed, "server", rnd), evaluating=evaluating,
            num_rounds=num_rounds, eval_clients=eval_clients)

    def run_round(self, rnd: int, evaluating: bool = False, num_rounds: int | None = None,
                  on_reply: Callable[[int, Message], None] | None = None,
                  eval_clients: list[int] | None = None) -> RoundStats:
        """One round. ``on_reply(cid, reply)`` sees each reply of its phases as the loop applies it
        (the runner keeps the local models that ``eval.local_risk`` tests); ``eval_clients``: the
        clients whose own models the evaluation after it tests (None: every client), which an
        evaluation-only phase serves (``RoundContext.eval_clients``)."""
        ctx = self.round_context(rnd, evaluating, num_rounds, eval_clients)
        stats = RoundStats(rnd, ctx.clients)
        gen = self.algorithm.round(self.server_state, ctx)
        replies: Replies | None = None
        t_train = 0.0
        t0 = time.perf_counter()
        try:
            while True:
                phase = gen.send(replies)      # type: ignore[arg-type]  # the first send must be None
                stats.phases += 1
                t1 = time.perf_counter()
                replies = self.deliver_phase(phase, rnd, stats, on_reply)
                t_train += time.perf_counter() - t1
        except StopIteration as stop:
            new_state = stop.value
        if new_state is None:
            raise RuntimeError(f"{self.algorithm.name}.round() returned no server state")
        self.server_state = new_state
        stats.train_seconds = t_train
        stats.aggregate_seconds = time.perf_counter() - t0 - t_train
        return stats

    def deliver_phase(self, phase: Phase, rnd: int, stats: RoundStats,
                      on_reply: Callable[[int, Message], None] | None = None) -> Replies:
        keep = not self.transport.keeps_client_state
        jobs = [Job(cid, msg, self.client_states.get(cid) if keep else None, stats.tally(cid))
                for cid, msg in phase.items()]
        for job in jobs:
            self.ledger.record(rnd, "down", job.message)
        results = self.transport.deliver(rnd, jobs)
        replies: Replies = {}
        for job in jobs:               # the phase's order, whatever order the transport finished in
            result = results.get(job.cid)
            if result is None:
                continue
            if keep:
                if result.state is None:
                    if job.cid in self.client_states:      # del, not pop: a spilled state is not read
                        del self.client_states[job.cid]
                else:
                    self.client_states[job.cid] = result.state
            stats.apply(job.cid, job.tally, result.tally)
            self.ledger.record(rnd, "up", result.reply)
            replies[job.cid] = result.reply
            if on_reply is not None:
                on_reply(job.cid, result.reply)
        return replies

    # --- evaluation support -------------------------------------------------------------
    def client_model(self, cid: int) -> Arrays:
        # The server state is on the CPU; a client state kept on the device (run.client_state:
        # device) joins it there, so a method may combine the two (FedRoD adds its personal head).
        # a state the method does not read to evaluate is not loaded (the store may hold it on disk)
        state = to_device(self.client_states.get(cid), "cpu") if self.algorithm.client_model_reads_state() else None
        weights = self.algorithm.client_model(cid, self.server_state, state)
        return weights if weights is not None else self.host.init_models[self.host.client_arch[cid]]

    # --- checkpointing ------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        # client states may live on the device (run.client_state: device); a checkpoint holds them on
        # the CPU, or names their files where the store spilled them (engine/client_store.py)
        return {"server_state": self.server_state, "client_states": self.client_states.snapshot(),
                "ledger": self.ledger.state_dict()}

    def snapshot_saved(self) -> None:
        """The last :meth:`snapshot` is on disk: what only earlier checkpoints needed may go."""
        self.client_states.commit()

    def restore(self, snap: dict[str, Any]) -> None:
        self.server_state = snap["server_state"]
        self.client_states.restore(snap["client_states"])
        self.ledger.load_state_dict(snap["ledger"])

    def close(self) -> None:
        self.transport.close()
        self.host.release()

    def __enter__(self) -> RoundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
