"""Building everything a run needs from a config: pure, no files written.

:func:`build` is used by the run loop (:mod:`fedhet.experiment.runner`) and by a Flower node,
which needs the same federation, models, algorithm and settings to run its clients bit for bit
as the simulator does, and nothing else.
"""

from __future__ import annotations

import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path

import pydantic
import torch

from fedhet.algorithms import algorithm_class
from fedhet.algorithms.base import Algorithm
from fedhet.core.contract import Arrays, TrainSettings, optimizer_state_kept
from fedhet.core.cpus import usable_cpus
from fedhet.core.errors import ConfigError
from fedhet.core.plugins import is_import_path
from fedhet.core.seeding import derive_seed
from fedhet.data.federated import Federation, build_federation
from fedhet.engine import ClientHost, ClientStates
from fedhet.experiment.config import ExperimentConfig, RunConfig, validation_problems
from fedhet.models import build_model
from fedhet.training.determinism import use_deterministic_algorithms
from fedhet.training.precision import auto_precision


def configure_process(cfg: ExperimentConfig) -> None:
    """Process-wide settings a run asks for: ``run.threads`` torch intra-op threads and
    ``run.deterministic`` kernels. Every process that trains this run's clients applies them (the
    runner, each Flower node), so float sums are the same everywhere. Neither is undone when the
    run ends (a later run in the same process that asks for neither keeps them)."""
    if cfg.run.threads:
        if cfg.run.threads > (cpus := usable_cpus()):
            warnings.warn(f"run.threads {cfg.run.threads} is more than the {cpus} CPU(s) this process may use: the "
                          "threads take turns on them and a round runs slower; set run.threads to at most "
                          f"{cpus}", stacklevel=2)
        torch.set_num_threads(cfg.run.threads)
    if cfg.run.deterministic:
        use_deterministic_algorithms()


def make_algorithm(cfg: ExperimentConfig) -> Algorithm:
    try:
        cls = algorithm_class(cfg.algorithm.name)
    except ConfigError as e:
        raise ConfigError(f"algorithm.name: {e}") from e.__cause__
    try:
        params = cls.Params.model_validate(cfg.algorithm.params)
    except pydantic.ValidationError as e:
        problems = validation_problems(e, cls.Params, "algorithm.params", unknown="parameter", listed="")
        bad = "; ".join(f"{key}: {'; or '.join(msgs)}" for key, msgs in problems.items())
        raise ConfigError(f"{bad} (accepted parameters of {cls.name}: "
                          f"{', '.join(cls.Params.model_fields) or 'none'}; their defaults: fedhet list "
                          f"{shlex.quote(cfg.algorithm.name)})") from None
    if cls.requires_sgd and cfg.train.optimizer != "sgd":
        raise ConfigError(f"algorithm {cfg.algorithm.name}: its server rule is derived for local SGD (the "
                          f"normalised update of SCAFFOLD / FedNova), so train.optimizer must be sgd, not "
                          f"{cfg.train.optimizer}")
    if cls.requires_sgd and cfg.train.momentum and optimizer_state_kept(cfg.train.optimizer_state,
                                                                          cls.keeps_optimizer_state):
        how = ("train.optimizer_state: keep" if cfg.train.optimizer_state == "keep" else
               "train.optimizer_state: auto, which keeps it for a composition with a method that keeps it")
        raise ConfigError(f"algorithm {cfg.algorithm.name}: its server rule counts each round's local SGD steps "
                          f"from zero momentum (FedNova's a_i, SCAFFOLD's c_i), so momentum carried across rounds "
                          f"({how}) would move the model by amounts it does not count; use "
                          f"train.optimizer_state: reset, or train.momentum: 0")
    algorithm = cls(params)
    algorithm.check_schedule(cfg.train.rounds, cfg.train.local_epochs)
    algorithm.check_round_size(cfg.train.clients_per_round)
    return algorithm


def build_models(cfg: ExperimentConfig, fed: Federation) -> tuple[dict[str, torch.nn.Module], list[str]]:
    """One model instance per architecture, initialised from the run seed; client i gets archs[i % n]."""
    archs = cfg.model.archs()
    models = {}
    for arch in dict.fromkeys(archs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "init", arch))
            try:
                models[arch] = build_model(arch, in_channels=fed.in_channels, num_classes=fed.num_classes,
                                           image_size=fed.image_size, split=cfg.model.split, norm=cfg.model.norm,
                                           **cfg.model.options_of(arch))
            except (ValueError, TypeError, RuntimeError, MemoryError) as e:
                raise _model_error(arch, cfg.model.options_of(arch), e) from (e if is_import_path(arch) else None)
    return models, [archs[i % len(archs)] for i in range(fed.num_clients)]


def _model_error(arch: str, options: dict, e: Exception) -> ConfigError:
    """What went wrong building ``arch``. A builder of one's own keeps its traceback (chained by the
    caller); memory is blamed only when the error is about memory."""
    first = (str(e).splitlines() or [""])[0] or type(e).__name__
    if isinstance(e, (ValueError, TypeError)):
        return ConfigError(f"model {arch}: {e}")
    if isinstance(e, MemoryError) or "alloc" in first.lower() or "memory" in first.lower():
        return ConfigError(f"model {arch} could not be built with options {options}: {first}; check model.options / "
                           "model.arch_options (a projection_dim or width of that size does not fit in memory)")
    return ConfigError(f"model {arch} could not be built with options {options}: {type(e).__name__}: {first}; "
                       "check model.options / model.arch_options and the input size the dataset gives it")


def resolve_device(requested: str) -> str:
    """``run.device`` for this machine: ``auto`` is ``cuda`` where torch sees a CUDA device, else
    ``cpu``; a CUDA device this machine lacks is a ConfigError (not a crash deep in training)."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device: {requested}, but torch {torch.__version__} sees no CUDA device on this "
                              "machine (a CPU build of torch, or no GPU); use run.device: cpu, or auto (CUDA "
                              "where present)")
        index = int(requested.split(":", 1)[1]) if ":" in requested else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"run.device: {requested}, but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return requested


def resolve_precision(requested: str, device: str = "cpu") -> str:
    # 'auto' means bf16 only where the hardware runs it natively AND precision.AUTO_BF16 is on (it
    # is, since the bf16 accuracy check passed; docs/performance.md).
    return auto_precision(device) if requested == "auto" else requested


def train_settings(cfg: ExperimentConfig, precision: str) -> TrainSettings:
    t = cfg.train
    return TrainSettings(epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                         weight_decay=t.weight_decay, drop_last=t.drop_last, clip_grad_norm=t.clip_grad_norm,
                         precision=precision, optimizer=t.optimizer, betas=t.betas,
                         optimizer_state=t.optimizer_state, memory_format=cfg.run.memory_format)


def headline_metric(algorithm: Algorithm, federation: Federation) -> str:
    """personal_acc for personalized methods and wherever there is no global test set (train+test
    pooled, FedReMa's protocol, where FedAvg's global model is tested on the local splits); else global_acc."""
    if algorithm.personalized or not algorithm.has_global_model or federation.test is None:
        return "personal_acc"
    return "global_acc"


@dataclass
class Built:
    """What a config builds: the algorithm, the federation, the models and the client host."""

    cfg: ExperimentConfig
    algorithm: Algorithm
    federation: Federation
    models: dict[str, torch.nn.Module]
    client_arch: list[str]
    precision: str
    host: ClientHost
    metric: str                     # the headline metric (headline_metric)
    device: str = "cpu"             # run.device resolved for this machine (resolve_device)


def algorithm_and_federation(cfg: ExperimentConfig) -> tuple[Algorithm, Federation]:
    """The config's algorithm and federation, the data checked against the method
    (``Algorithm.check_data`` on client 0's view: the shared pools, data.public included)."""
    algorithm = make_algorithm(cfg)
    if cfg.eval.features_every and not algorithm.has_global_model:
        raise ConfigError(f"eval.features_every: the feature-space metrics are of the global model, and "
                          f"{algorithm.name} has none (each client keeps a model of its own): drop eval.features_every")
    federation = build_federation(cfg.data, cfg.seed)
    if cfg.train.drop_last:
        sizes = federation.train_counts().sum(axis=1)
        if sizes.max() < cfg.train.batch_size:
            # every batch would be dropped: the run would end 'completed' without one training step
            raise ConfigError(f"train.batch_size ({cfg.train.batch_size}) exceeds every client's training data "
                              f"(the largest client holds {int(sizes.max())} samples) and train.drop_last is on, so "
                              "no client would take a single step: lower train.batch_size, or set train.drop_last: "
                              "false")
        short = [int(c) for c in (sizes < cfg.train.batch_size).nonzero()[0]]
        if short:
            named = ", ".join(map(str, short[:10])) + (", ..." if len(short) > 10 else "")
            warnings.warn(f"{len(short)} of {len(sizes)} clients hold fewer training samples than train.batch_size "
                          f"({cfg.train.batch_size}) and train.drop_last is on: they take no local step and end each "
                          f"round with the model they started it with (clients {named}). Lower train.batch_size, "
                          "or set train.drop_last: false, to train them", stacklevel=2)
    algorithm.check_data(federation.client_data(0))
    return algorithm, federation


def check_local_risk(algorithm: Algorithm, models: dict[str, torch.nn.Module]) -> None:
    """``eval.local_risk`` judges the whole model each client's ``"model"`` upload stands for
    (``local_model``): refused for a method that uploads only part of it (FedPer's body), which
    would be judged with the untrained initial head."""
    uploaded_model = getattr(algorithm, "uploaded_model", None)
    if uploaded_model is None:
        return
    for arch, model in models.items():
        weights = dict(model.state_dict())
        _, missing = whole_local_model(algorithm, uploaded_model(weights), weights)
        if missing:
            raise ConfigError(f"eval.local_risk: {algorithm.name}'s clients upload only part of their {arch} model "
                              f"({missing_names(missing)} stay on the client), so the local models' risk would be "
                              "measured with the initial weights in its place; set eval.local_risk: false for "
                              "this method")


def whole_local_model(algorithm: Algorithm, uploaded: Arrays, init: Arrays) -> tuple[Arrays, list[str]]:
    """The whole local model an uploaded ``"model"`` stands for (``local_model``, where the method
    has one), and the names of ``init`` it still lacks."""
    local_model = getattr(algorithm, "local_model", None)
    model = local_model(uploaded, init) if local_model is not None else uploaded
    return model, sorted(init.keys() - model.keys())


def missing_names(names: list[str]) -> str:
    """The first three of ``names``, then how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def build(cfg: ExperimentConfig) -> Built:
    algorithm, federation = algorithm_and_federation(cfg)
    models, client_arch = build_models(cfg, federation)
    device = resolve_device(cfg.run.device)
    precision = resolve_precision(cfg.run.precision, device)
    host = ClientHost(algorithm, federation, models, client_arch, train_settings(cfg, precision), cfg.seed,
                      device=device, state_on_device=cfg.run.client_state == "device", lr_decay=cfg.train.lr_decay)
    if cfg.eval.local_risk:         # after the host's check_model: a model the method cannot use is named first
        check_local_risk(algorithm, models)
    return Built(cfg, algorithm, federation, models, client_arch, precision, host,
                 headline_metric(algorithm, federation), device)


def client_state_store(run: RunConfig, run_dir: Path) -> ClientStates:
    """The store of the clients' persistent states that ``run.client_state_store`` asks for, spilling
    to ``run_dir/client_states``."""
    budget = None if run.client_state_memory_mb is None else run.client_state_memory_mb << 20
    return ClientStates(run_dir / "client_states", run.client_state_store, budget)
