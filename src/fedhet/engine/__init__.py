"""Engines: who carries a round's messages and trains the clients. All share the Simulator's
interface (``run_round``, ``server_state``, ``client_states``, ``snapshot``/``restore``, ...).

* ``reference`` (:mod:`fedhet.engine.reference`): one process, clients one after another; the
  ground truth.
* ``parallel`` (:mod:`fedhet.engine.parallel`): each phase's clients in N forked CPU worker
  processes with one intra-op thread each; bit-identical to ``reference`` at one thread.
* ``vectorized`` (:mod:`fedhet.engine.vectorized`): the clients of a phase trained together
  with ``torch.func.vmap``; for accelerators.

:func:`choose_engine` holds the ``auto`` rule (``run.engine``, ``run.workers``); the
measurements behind it are in docs/performance.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fedhet.engine.parallel import ParallelSimulator, fork_available, usable_cpus
from fedhet.engine.reference import Simulator
from fedhet.errors import ConfigError

ENGINES = ("auto", "reference", "parallel", "vectorized")

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


def vectorized_available() -> bool:
    """True when fedhet.engine.vectorized imports and reports an accelerator."""
    try:
        from fedhet.engine import vectorized
    except ImportError:
        return False
    return bool(getattr(vectorized, "available", lambda: False)())


def _is_cuda(device: str | None) -> bool:
    return str(device or "cpu").startswith("cuda")


def choose_engine(engine: str = "auto", workers: int | str = "auto", device: str | None = "cpu", *,
                  clients_per_round: int = 1, round_samples: float | None = None,
                  cpus: int | None = None, threads: int | None = None) -> EngineChoice:
    """Resolve ``run.engine`` / ``run.workers`` for this machine and run.

    ``auto``: ``vectorized`` on a CUDA device; on a CPU, ``parallel`` with one worker per usable
    core (at most one per client of a round) when there are at least 2 of each and a round trains
    at least ``AUTO_PARALLEL_MIN_ROUND_SAMPLES`` sample-steps (``round_samples``, when known);
    otherwise ``reference``. ``threads`` (``run.threads``), when set, is the run's CPU budget and
    caps the usable cores: ``threads: 1`` keeps a run on one core (side-by-side benchmark lanes).
    An explicit ``workers: N`` with ``auto`` means ``parallel`` for N > 1, ``reference`` for 1.
    """
    if engine not in ENGINES:
        raise ConfigError(f"run.engine: unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"run.workers: expected 'auto' or a positive integer, got {workers!r}")
    cpus = cpus or usable_cpus()
    if threads:
        cpus = min(cpus, threads)
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
            return EngineChoice("parallel", n, f"requested; workers = min(usable CPUs {cpus}, clients per "
                                               f"round {clients_per_round})")
        return EngineChoice("parallel", workers, "requested")
    # auto
    if cuda:
        if vectorized_available():
            return EngineChoice("vectorized", 1, f"auto: device {device}")
        return EngineChoice("reference", 1, f"auto: device {device} but the vectorized engine is unavailable")
    if workers != "auto":
        if workers == 1:
            return EngineChoice("reference", 1, "auto: workers 1")
        return EngineChoice("parallel", workers, "auto: workers requested")
    n = min(cpus, clients_per_round)
    if not fork_available():
        return EngineChoice("reference", 1, "auto: this platform cannot fork worker processes")
    if n < 2:
        return EngineChoice("reference", 1, f"auto: {cpus} usable CPU(s), {clients_per_round} client(s) per round")
    if round_samples is not None and round_samples < AUTO_PARALLEL_MIN_ROUND_SAMPLES:
        return EngineChoice("reference", 1, f"auto: a round trains about {round_samples:.0f} sample-steps "
                                            f"(< {AUTO_PARALLEL_MIN_ROUND_SAMPLES}), too little to gain from workers")
    return EngineChoice("parallel", n, f"auto: {cpus} usable CPUs, {clients_per_round} clients per round")


def round_sample_estimate(federation, settings, clients_per_round: int) -> float:
    """Expected sample-steps of one round: mean client size x epochs x clients per round."""
    sizes = [len(t) for t in federation.train_idx]
    return sum(sizes) / max(len(sizes), 1) * settings.epochs * clients_per_round


def make_engine(algorithm, federation, models, client_arch, settings, clients_per_round: int, seed: int, *,
                engine: str = "auto", workers: int | str = "auto", device: str | None = "cpu",
                threads: int | None = None) -> Simulator:
    """The engine for these inputs (``Simulator``'s constructor arguments), chosen by
    :func:`choose_engine`; the choice is kept as ``engine.engine_choice``."""
    choice = choose_engine(engine, workers, device, clients_per_round=clients_per_round,
                           round_samples=round_sample_estimate(federation, settings, clients_per_round),
                           threads=threads)
    args = (algorithm, federation, models, client_arch, settings, clients_per_round, seed)
    if choice.engine == "reference":
        sim = Simulator(*args)
    elif choice.engine == "parallel":
        sim = ParallelSimulator(*args, workers=choice.workers)
    else:
        try:
            from fedhet.engine.vectorized import VectorizedSimulator
        except ImportError as e:
            raise ConfigError(f"run.engine: vectorized is not available ({e})") from None
        sim = VectorizedSimulator(*args, device=None if device in (None, "auto") else device)
    sim.engine_choice = choice
    return sim


def engine_info(sim) -> dict:
    """``{"engine", "workers", "reason"}`` of an engine instance, for summaries and benchmarks."""
    choice = getattr(sim, "engine_choice", None)
    names = {"Simulator": "reference", "ParallelSimulator": "parallel", "VectorizedSimulator": "vectorized"}
    name = names.get(type(sim).__name__, type(sim).__name__)
    info = {"engine": name, "workers": getattr(sim, "workers", 1)}
    if choice is not None and choice.engine == name:
        info["reason"] = choice.reason
    return info


__all__ = ["AUTO_PARALLEL_MIN_ROUND_SAMPLES", "ENGINES", "EngineChoice", "ParallelSimulator", "Simulator",
           "choose_engine", "engine_info", "make_engine", "round_sample_estimate", "vectorized_available"]
