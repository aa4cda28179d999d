"""Engines: one round loop (:class:`fedhet.engine.loop.RoundLoop`: server state, client states,
ledger, random streams) and transports that only deliver a phase's jobs:

* ``reference`` (:class:`fedhet.engine.loop.InProcess`): one process, clients one after another;
  the ground truth.
* ``parallel`` (:class:`fedhet.engine.parallel.Forked`): each phase's clients in N forked CPU
  worker processes with one intra-op thread each; bit-identical to ``reference`` at one thread.
* ``vectorized`` (:class:`fedhet.engine.vectorized.Vectorized`): the clients of a phase trained
  together with ``torch.func.vmap``; for accelerators.
* Flower's Grid (:mod:`fedhet.flower.engine`), on top.

:func:`choose_engine` holds the ``auto`` rule (``run.engine``, ``run.workers``); the
measurements behind it are in docs/performance.md.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import get_args

from fedhet.core.choices import EngineName
from fedhet.core.cpus import usable_cpus
from fedhet.core.errors import ConfigError
from fedhet.engine.client_store import ClientStates
from fedhet.engine.host import ClientHost
from fedhet.engine.loop import InProcess, RoundLoop, Transport
from fedhet.engine.parallel import Forked, fork_available

ENGINES: tuple[str, ...] = get_args(EngineName)

# ``auto`` uses worker processes only when a round trains at least this many sample-steps:
# below it (test-sized runs) the fork and the per-client message transport cost more than the
# second core gains. Measured in benchmarks/engine_speed.py; see docs/performance.md.
AUTO_PARALLEL_MIN_ROUND_SAMPLES = 2000


@dataclass(frozen=True)
class EngineChoice:
    engine: str            # reference | parallel | vectorized
    workers: int           # worker processes (1 unless parallel)
    reason: str            # why (recorded in summary.json)

    def as_dict(self) -> dict:
        return asdict(self)


def vectorized_unavailable() -> str | None:
    """Why the vectorized engine cannot serve ``auto`` here (``None`` when it can): its module fails to
    import, or it reports no accelerator."""
    try:
        from fedhet.engine import vectorized
    except ImportError as e:
        return f"fedhet.engine.vectorized does not import ({type(e).__name__}: {e})"
    if not getattr(vectorized, "available", lambda: False)():
        return "no CUDA device is visible to torch"
    return None


def _is_cuda(device: str | None) -> bool:
    return str(device or "cpu").startswith("cuda")


def _explicit_workers(workers: int, cpus: int, clients_per_round: int, how: str,
                      usable: str = "usable CPU(s)") -> EngineChoice:
    """``run.workers: N``: no more workers than clients a round (the others would only start and
    wait; results do not depend on the count), and a reason that says so and when they share cores."""
    n = min(workers, clients_per_round)
    reason = how
    if n < workers:
        reason += f"; {workers} workers asked for, {clients_per_round} clients a round: {n} started"
    if n > cpus:
        reason += f"; {n} workers share {cpus} {usable}, which slows every worker"
    if n == 1 and how.startswith("auto"):
        return EngineChoice("reference", 1, reason + "; one worker is the reference engine")
    return EngineChoice("parallel", n, reason)


def choose_engine(engine: str = "auto", workers: int | str = "auto", device: str | None = "cpu", *,
                  clients_per_round: int = 1, round_samples: float | None = None,
                  cpus: int | None = None, threads: int | None = None) -> EngineChoice:
    """Resolve ``run.engine`` / ``run.workers`` for this machine and run.

    ``auto``: ``vectorized`` on a CUDA device; on a CPU, ``parallel`` with one worker per usable
    core (at most one per client of a round) when there are at least 2 of each and a round trains
    at least ``AUTO_PARALLEL_MIN_ROUND_SAMPLES`` sample-steps (``round_samples``, when known);
    otherwise ``reference``. ``threads`` (``run.threads``), when set, is the run's CPU budget and
    caps the usable cores: ``threads: 1`` keeps a run on one core (side-by-side benchmark lanes).
    An explicit ``workers: N`` with ``auto`` means ``parallel`` for N > 1, ``reference`` for 1; on a
    CUDA device it is ignored (worker processes are CPU-only), with a warning and in the reason.
    """
    if engine not in ENGINES:
        raise ConfigError(f"run.engine: unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"run.workers: expected 'auto' or a positive integer, got {workers!r}")
    cpus = cpus or usable_cpus()
    usable = "usable CPU(s)"                 # what the reasons below call the budget
    if threads and threads < cpus:
        cpus, usable = threads, "CPU(s) of run.threads"
    cuda = _is_cuda(device)
    if engine in ("reference", "vectorized"):
        if workers != "auto" and workers > 1:
            raise ConfigError(f"run.workers: {workers} worker processes need run.engine: parallel (or auto), "
                              f"not {engine}")
        return EngineChoice(engine, 1, "requested")
    if engine == "parallel":
        if cuda:
            raise ConfigError("run.engine: parallel forks CPU worker processes and cannot run on "
                              f"device {device!r}; use vectorized (or auto) there")
        if not fork_available():
            raise ConfigError("run.engine: parallel needs the 'fork' start method (Linux); use reference")
        if workers == "auto":
            n = max(1, min(cpus, clients_per_round))
            return EngineChoice("parallel", n, f"requested; workers = min({usable} {cpus}, clients per "
                                               f"round {clients_per_round})")
        return _explicit_workers(workers, cpus, clients_per_round, "requested", usable)
    # auto
    if cuda:
        why = vectorized_unavailable()
        notes = [] if why is None else [f"the vectorized engine is unavailable ({why}); training on the "
                                        "reference path, one client at a time"]
        if workers not in ("auto", 1):
            notes.append(f"run.workers {workers} ignored: worker processes are CPU-only")
        if notes:      # the slower path or the ignored setting named where it is taken, not only in summary.json
            warnings.warn(f"run.engine auto on {device}: {'; '.join(notes)}", RuntimeWarning, stacklevel=2)
        return EngineChoice("vectorized" if why is None else "reference", 1, "; ".join([f"auto: device {device}", *notes]))
    if workers != "auto":
        if workers == 1:
            return EngineChoice("reference", 1, "auto: workers 1")
        return _explicit_workers(workers, cpus, clients_per_round, "auto: workers requested", usable)
    n = min(cpus, clients_per_round)
    if not fork_available():
        return EngineChoice("reference", 1, "auto: this platform cannot fork worker processes")
    if n < 2:
        return EngineChoice("reference", 1, f"auto: {cpus} {usable}, {clients_per_round} client(s) per round")
    if round_samples is not None and round_samples < AUTO_PARALLEL_MIN_ROUND_SAMPLES:
        return EngineChoice("reference", 1, f"auto: a round trains about {round_samples:.0f} sample-steps "
                                            f"(< {AUTO_PARALLEL_MIN_ROUND_SAMPLES}), too little to gain from workers")
    return EngineChoice("parallel", n, f"auto: {cpus} {usable}, {clients_per_round} clients per round")


def round_sample_estimate(federation, settings, clients_per_round: int) -> float:
    """Expected sample-steps of one round: mean client size x epochs x clients per round."""
    sizes = [len(t) for t in federation.train_idx]
    return sum(sizes) / max(len(sizes), 1) * settings.epochs * clients_per_round


def make_transport(choice: EngineChoice, device: str | None = "cpu", cuda_graphs: bool = True,
                   keep_graphs: bool = True) -> Transport:
    """The transport an :class:`EngineChoice` names. ``keep_graphs`` (``run.keep_graphs``) takes effect
    where CUDA graphs replay."""
    if choice.engine == "reference":
        return InProcess()
    if choice.engine == "parallel":
        return Forked(workers=choice.workers)
    try:
        from fedhet.engine.vectorized import Vectorized
    except ImportError as e:
        raise ConfigError(f"run.engine: vectorized is not available ({e})") from None
    return Vectorized(device=None if device in (None, "auto") else device, cuda_graphs=cuda_graphs,
                      keep_graphs=None if keep_graphs else False)


def make_loop(host: ClientHost, clients_per_round: int, *, engine: str = "auto", workers: int | str = "auto",
              device: str | None = "cpu", threads: int | None = None,
              cuda_graphs: bool = True, keep_graphs: bool = True,
              client_states: ClientStates | None = None) -> tuple[RoundLoop, EngineChoice]:
    """The round loop for ``host`` with the transport :func:`choose_engine` picks, and that choice;
    ``client_states``: where the clients' persistent states live (default: in memory)."""
    choice = choose_engine(engine, workers, device, clients_per_round=clients_per_round,
                           round_samples=round_sample_estimate(host.federation, host.settings, clients_per_round),
                           threads=threads)
    if choice.engine == "vectorized" and host.settings.memory_format == "channels_last":
        raise ConfigError("run.memory_format: channels_last is how the reference and parallel engines train; "
                          "the vectorized engine trains in the default layout. Set run.engine: reference "
                          f"(or parallel on a CPU), or run.memory_format: auto ({choice.reason})")
    transport = make_transport(choice, device, cuda_graphs, keep_graphs)
    return RoundLoop(host, clients_per_round, transport, client_states), choice


__all__ = ["AUTO_PARALLEL_MIN_ROUND_SAMPLES", "ENGINES", "ClientHost", "ClientStates", "EngineChoice", "Forked", "InProcess",
           "RoundLoop", "Transport", "choose_engine", "make_loop", "make_transport", "round_sample_estimate",
           "vectorized_unavailable"]
