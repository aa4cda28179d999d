"""The run configuration: one validated, documented schema; unknown keys are errors.

A YAML file (see configs/) plus ``--set key=value`` overrides is parsed into
:class:`ExperimentConfig`. Every error names the offending key and says what is accepted.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from fedhet.core.choices import EngineName, StoreMode
from fedhet.core.errors import ConfigError, FedhetError
from fedhet.core.settings import refuse_quiet_values
from fedhet.core.suggest import did_you_mean
from fedhet.experiment.yaml_io import parse_yaml, read_yaml, refuse_glued_colon


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_quiet_values(cls, data: Any) -> Any:
        return refuse_quiet_values(cls.model_fields, data)       # `rounds: true`, `weight_decay: .inf`


class PartitionConfig(BaseModel):
    """``kind`` plus that partitioner's own parameters (checked by the partitioner)."""

    model_config = ConfigDict(extra="allow")
    kind: str = "dirichlet"

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class LocalTestConfig(Strict):
    # holdout: a fraction of each client's own data is held out (FedFM, FedReMa);
    # test_set: drawn from the global test set with the client's label proportions (FedClassAvg, FedNH).
    source: Literal["holdout", "test_set"] = "test_set"
    fraction: float = Field(0.2, gt=0, lt=1)
    # test_set only: draw each class's share with replacement (FedClassAvg's code does), so a client
    # may need more images of a class than the test set holds; default: a duplicate-free split.
    replace: bool = False

    @pydantic.model_validator(mode="after")
    def _replace_needs_test_set(self) -> LocalTestConfig:
        if self.replace and self.source != "test_set":
            raise ValueError("data.local_test.replace draws from the global test set: it needs "
                             "data.local_test.source: test_set (a held-out split is the client's own images, once each)")
        return self


class PublicConfig(Strict):
    """Unlabelled public data for knowledge-transfer methods (KT-pFL), disjoint from every client's
    training and local-test images (fedhet.data.federated)."""

    # unsampled: from the pool images data.pool_fraction leaves out (the partition is unchanged);
    # holdout: carved class-stratified out of the pool before the partition;
    # dataset: the train split of another dataset of the same image shape (KT-pFL: mnist, cifar100).
    source: Literal["unsampled", "holdout", "dataset"] = "holdout"
    size: int = Field(3000, ge=1)
    dataset: str | None = None
    classes: list[int] | None = None   # with source dataset: only these classes (KT-pFL's CIFAR-100 subset)

    @pydantic.model_validator(mode="after")
    def _dataset_fields(self) -> PublicConfig:
        if self.source == "dataset" and not self.dataset:
            raise ValueError("data.public.source 'dataset' needs data.public.dataset (e.g. mnist)")
        if self.source != "dataset" and (self.dataset is not None or self.classes is not None):
            given = [k for k in ("dataset", "classes") if getattr(self, k) is not None]
            raise ValueError(f"data.public.dataset and .classes only apply with data.public.source: dataset; with "
                             f"source {self.source!r} leave them out "
                             f"({', '.join(f'--set data.public.{k}=null' for k in given)} over a config that sets "
                             f"{'them' if len(given) > 1 else 'it'})")
        return self


class NormalizeConfig(Strict):
    """Per-channel input normalisation ``(x / 255 - mean) / std`` in place of the dataset's
    training-set statistics, e.g. ``{mean: [0.5], std: [0.5]}`` as PFLlib's and FedReMa's data
    generators normalise Fashion-MNIST."""

    mean: list[float] = Field(min_length=1)
    std: list[Annotated[float, Field(gt=0)]] = Field(min_length=1)


class DataConfig(Strict):
    dataset: str = "fashion_mnist"
    root: str | None = None            # default: $FEDHET_DATA, ~/.cache/fedhet/data, Debian's dataset dir
    download: bool = False
    verify: bool = True                # check known files against their published checksums
    pool: Literal["train", "train+test"] = "train"   # train+test: FedReMa pools both before partitioning
    # Keep this fraction of every class of the pool (a seeded draw) before partitioning: reduced
    # reproductions on fewer samples with the same label proportions. 1 = the whole pool.
    pool_fraction: float = Field(1.0, gt=0, le=1)
    num_clients: int = Field(50, ge=1)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    local_test: LocalTestConfig = Field(default_factory=LocalTestConfig)
    public: PublicConfig | None = None
    normalize: NormalizeConfig | None = None       # default: the dataset's training-set mean and std


class ModelConfig(Strict):
    # One architecture, or a list assigned round-robin (client i gets arch[i % len]) as in FedClassAvg.
    arch: str | list[str] = "cnn2"
    # First head stage; default: the model's own (its last Linear; alexnet_fedrema: fc1).
    split: str | None = None
    norm: Literal["bn", "gn"] = "bn"
    options: dict[str, Any] = Field(default_factory=dict)          # builder options of every arch
    # Options of one architecture only, over `options`: e.g. {fca_googlenet: {dropout: 0.2}}.
    arch_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def archs(self) -> list[str]:
        return [self.arch] if isinstance(self.arch, str) else list(self.arch)

    def options_of(self, arch: str) -> dict[str, Any]:
        return {**self.options, **self.arch_options.get(arch, {})}

    @pydantic.model_validator(mode="after")
    def _arch_list_not_empty(self) -> ModelConfig:
        if not self.archs() or not all(isinstance(a, str) and a for a in self.archs()):
            raise ValueError(f"model.arch must name an architecture or a non-empty list of them, got {self.arch!r} "
                             "(fedhet list shows the models)")
        return self

    @pydantic.model_validator(mode="after")
    def _options_leave_fedhets_arguments_alone(self) -> ModelConfig:
        # what every builder is called with; an option of the same name would be a second value for it
        given_by_fedhet = {"in_channels": "the data; leave it out", "num_classes": "the data; leave it out",
                           "image_size": "the data; leave it out", "split": "model.split; set model.split instead",
                           "norm": "model.norm; set model.norm instead"}
        for where, options in [("model.options", self.options),
                               *((f"model.arch_options.{a}", o) for a, o in self.arch_options.items())]:
            for key in sorted(set(options) & set(given_by_fedhet)):
                raise ValueError(f"{where}.{key}: every model builder gets {key} from {given_by_fedhet[key]}")
        return self

    @pydantic.model_validator(mode="after")
    def _arch_options_name_archs(self) -> ModelConfig:
        unknown = sorted(set(self.arch_options) - set(self.archs()))
        if unknown:
            raise ValueError(f"model.arch_options names {unknown}, which model.arch does not list "
                             f"({', '.join(self.archs())})")
        return self


class AlgorithmConfig(Strict):
    name: str = "fedavg"
    params: dict[str, Any] = Field(default_factory=dict)


class TrainConfig(Strict):
    rounds: int = Field(100, ge=1)
    clients_per_round: int = Field(10, ge=1)
    local_epochs: int = Field(6, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.01, gt=0)
    # The local learning rate's decay across rounds: round t (1-based) trains at
    # lr * lr_decay ** (t - 1), every client and every method alike (1: a constant lr). 0.99 is the
    # "diminishing" schedule of the FedNH code base (Yutong-Dai/FedNH), whose setup FedACD's follows.
    lr_decay: float = Field(1.0, gt=0, le=1)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    drop_last: bool = False
    clip_grad_norm: float | None = Field(None, gt=0)
    # The local optimizer (fedhet.training.optim): "sgd" (torch.optim.SGD's rule, with momentum and
    # weight_decay above) or "adam" (torch.optim.Adam's, with betas; FedClassAvg uses (0.5, 0.999)).
    optimizer: Literal["sgd", "adam"] = "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    # Optimizer state (momentum, Adam moments) across rounds, for every method alike: "reset" (a
    # new optimizer each round, FedAvg's and PFLlib's baselines), "keep" (one optimizer per client
    # kept across its rounds, FedReMa's reference), "auto" (each method's own default: keep for
    # FedReMa, reset for the rest).
    optimizer_state: Literal["auto", "reset", "keep"] = "auto"

    @pydantic.model_validator(mode="after")
    def _optimizer_settings(self) -> TrainConfig:
        if self.optimizer == "adam" and self.momentum:
            raise ValueError("train.momentum is SGD's; with optimizer: adam set train.betas instead")
        # (not "betas" in model_fields_set: a run's recorded config.yaml holds every default)
        if self.optimizer == "sgd" and tuple(self.betas) != type(self).model_fields["betas"].default:
            raise ValueError("train.betas are Adam's; with optimizer: sgd they would do nothing: set "
                             "train.optimizer: adam, or drop train.betas (SGD's is train.momentum)")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas must lie in [0, 1), got {list(self.betas)}")
        return self


class EvalConfig(Strict):
    every: int = Field(1, ge=1)                    # evaluate every N rounds (and always after the last)
    final_window: int = Field(5, ge=1)             # "final" = mean of the last N evaluations
    batch_size: int = Field(2048, ge=1)
    personalized: bool = True                      # also test each client's model on its local test split
    # Whose local test splits: "all" clients, the round's "sampled" ones, or a fixed random subset of
    # N clients (drawn once from the run seed); the count is recorded as personal_clients.
    clients: Literal["all", "sampled"] | pydantic.PositiveInt = "all"
    # Every k rounds also record the global model's feature-space quality (feature_nmi,
    # feature_silhouette on features_samples test images; FedFM paper Table V). Needs scikit-learn.
    features_every: int | None = Field(None, ge=1)
    features_samples: int = Field(2000, ge=20)
    # At evaluated rounds also judge the round's uploaded local models over every client's label
    # distribution (local_risk, FedACD Table 3) and their KL(P || Q) (local_kl, Table 9).
    local_risk: bool = False
    # Precision of the evaluation passes: "fp32" always (metrics comparable across run precisions),
    # or "run": the run's resolved run.precision (bf16 autocast in a bf16 run; its metrics then carry
    # bf16 rounding). Evaluation runs on run.device: on a CPU, bf16 is only expected to be cheaper
    # where that CPU computes bf16 natively. feature_nmi/feature_silhouette and local_kl stay fp32.
    precision: Literal["fp32", "run"] = "fp32"


class RunConfig(Strict):
    out_dir: str = "runs"
    checkpoint_every: int = Field(10, ge=1)
    # cpu, cuda, cuda:N, or auto (cuda where a CUDA device is present, else cpu); a CUDA device
    # this machine lacks is an error when the run is built (experiment.build.resolve_device).
    device: str = "cpu"
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    # The layout local training's convolutions run in: "auto" (channels_last in bf16, the default
    # layout in fp32, whose rounding earlier fp32 results rest on), "contiguous" or "channels_last"
    # (in fp32 on a CPU often faster for convolutional models, with other last bits:
    # benchmarks/memory_format.py). The reference and parallel engines; vectorized refuses channels_last.
    memory_format: Literal["auto", "contiguous", "channels_last"] = "auto"
    # Engine: auto | reference | parallel | vectorized, and worker processes for parallel
    # (auto = one per usable CPU); the auto rule is fedhet.engine.choose_engine (docs/performance.md).
    engine: EngineName = "auto"
    workers: Literal["auto"] | pydantic.PositiveInt = "auto"
    threads: int | None = Field(None, ge=1)        # torch intra-op threads; default: torch's choice
    # torch's deterministic kernels (fedhet.training.determinism), process-wide like threads: for a
    # CUDA run that repeats bit for bit, at some speed (an operation without a deterministic kernel
    # stops the run with torch's error naming it). A CPU run repeats bitwise at fixed threads without it.
    deterministic: bool = False
    # The vectorized engine on CUDA replays the steps that recur in a group's schedule as CUDA
    # graphs (a failed capture is counted in the summary's engine.eager_reasons; those steps run eagerly).
    cuda_graphs: bool = True
    # Where those graphs replay, later groups of the same shape (architecture, settings, terms, number
    # of clients) train in the buffers of the first and replay its graphs instead of capturing their
    # own (fedhet.engine.vectorized), which spares each later group its eager warm-up and captures;
    # benchmarks/device_runs.py's fedcme_keep_graphs run measures it off and on
    # (benchmarks/results/gpu_h200_2026-11-27c/README.md).
    keep_graphs: bool = True
    # Where clients' persistent state (SCAFFOLD's controls, MOON's previous models, kept momentum,
    # personal models) lives between rounds on a device run: "cpu" (host memory; moved to the
    # device for each job and back, so large federations fit) or "device" (stays on run.device: no
    # transfers, device memory grows with the clients seen). Checkpoints hold it on the CPU either way.
    client_state: Literal["cpu", "device"] = "cpu"
    # The clients' persistent states in bounded memory (fedhet.engine.client_store): "auto" keeps the
    # most recently written ones in memory up to client_state_memory_mb and writes the others to
    # RUN_DIR/client_states (one torch.save file each); "memory" never writes them, "disk" writes
    # every one. Default budget: a quarter of the machine's RAM.
    client_state_store: StoreMode = "auto"
    client_state_memory_mb: int | None = Field(None, ge=0)
    progress: bool = True
    # Experiment tracking beside metrics.jsonl (fedhet.experiment.loggers; pip install -e .[tracking])
    loggers: list[Literal["tensorboard", "mlflow"]] = Field(default_factory=list)
    mlflow_tracking_uri: str | None = None          # default: sqlite:///RUN_DIR/mlflow.db

    @pydantic.field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|auto|cuda(:[0-9]+)?", value):
            raise ValueError(f"expected cpu, cuda, cuda:N or auto, got {value!r}")
        return value


# A run's number for a claim or a paper's rule (fedhet.experiment.verdict.run_value): its final or
# best value of a metric, or the metric at the first evaluated round where another is lowest/highest.
RUN_VALUE_PATTERN = r"final|best|(lowest|highest):\w+"


class PaperResult(Strict):
    """What a paper reports for the experiment a config describes; ``fedhet compare`` prints it
    beside the measured numbers. Never read by a run (editing it does not make a run stale)."""

    source: str                        # paper and table, e.g. "FedClassAvg (Jang et al., ICPP 2022) Table 2"
    cell: str = ""                     # the table cell, e.g. "FMNIST Dir(0.5), FedClassAvg"
    metric: str | None = None          # fedhet's metric it corresponds to (default: the run's headline)
    value: float                       # as fedhet reports the metric: a fraction, 0.9303 for 93.03%
    std: float | None = Field(None, ge=0)
    rule: str = ""                     # how the paper chose the number, e.g. "mean of the last 5 rounds"
    # How the measured number follows the paper's rule, so that compare's difference sets like
    # against like: final (default), best, or the metric at the round where another metric is
    # lowest or highest (lowest:personal_loss, highest:global_val_acc), as a sweep's verdicts take it.
    measured_as: str = Field("final", pattern=f"^({RUN_VALUE_PATTERN})$")
    rounds: int | None = Field(None, ge=1)   # the paper's T where it states it: fewer rounds run are said
    # Settings the run changed from the config that states the number (--set, fedhet.run's overrides,
    # a sweep's set lists), filled in when the config is loaded: compare says the difference is
    # not like for like. How a run is carried out (run.*), its evaluation, seed and name, and
    # train.rounds (said against `rounds`) are not counted.
    changed: list[str] = Field(default_factory=list)


class ExperimentConfig(Strict):
    name: str = "experiment"
    seed: int = 0
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    paper: PaperResult | None = None

    @pydantic.field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # the name becomes a folder name under run.out_dir: a path would put the run somewhere else
        if not name.strip() or "/" in name or "\\" in name or "\x00" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a plain name: a run's name names its folder under run.out_dir, so it "
                             "may not be empty, hold / or \\, or start with a dot; give a name such as "
                             "'fedavg_fmnist', and choose where the run goes with --out or run.out_dir")
        return name

    @pydantic.model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if self.train.clients_per_round > self.data.num_clients:
            raise ValueError(f"train.clients_per_round ({self.train.clients_per_round}) exceeds "
                             f"data.num_clients ({self.data.num_clients})")
        if self.eval.clients != "all" and not self.eval.personalized:
            raise ValueError(f"eval.clients ({self.eval.clients}) chooses whose local test splits the personalized "
                             "metrics use; with eval.personalized: false there are none - drop eval.clients or "
                             "set eval.personalized: true")
        archs = self.model.archs()
        if len(archs) > self.data.num_clients:
            raise ValueError(f"model.arch lists {len(archs)} architectures for {self.data.num_clients} clients "
                             f"(client i gets arch[i % {len(archs)}]): {archs[self.data.num_clients:]} would train "
                             "on no client; shorten the list or raise data.num_clients")
        natural = self.data.partition.kind == "natural"
        if (self.data.pool == "train+test" and self.data.local_test.source == "test_set"
                and not (natural and self.data.partition.options().get("test_writers"))):
            raise ValueError("data.pool 'train+test' leaves no separate test set: set data.local_test.source: holdout"
                             + (", or hold writers out as the test set (data.partition.test_writers)" if natural else ""))
        # settings that only mean something beside another: given alone they would do nothing
        if self.run.client_state_memory_mb is not None and self.run.client_state_store != "auto":
            raise ValueError(f"run.client_state_memory_mb is the budget of client_state_store: auto; the store "
                             f"{self.run.client_state_store!r} keeps {'every state in memory' if self.run.client_state_store == 'memory' else 'every state on disk'} "
                             "whatever the budget: drop it, or set run.client_state_store: auto")
        if self.run.mlflow_tracking_uri is not None and "mlflow" not in self.run.loggers:
            raise ValueError("run.mlflow_tracking_uri is where the mlflow logger writes, and run.loggers does not "
                             "list mlflow: add it (run.loggers: [mlflow]), or drop the uri")
        return self


# pydantic names the member of a union that a value failed against in the error's location
# (``eval.clients.literal['all','sampled']``, ``...constrained-int``): not a key a user writes
_UNION_MEMBER = re.compile(r"[\[\-']|^(int|str|float|bool|list|dict|none)$")


def _error_key(error: dict) -> str:
    """The key an error is about. An unknown key is named as the user wrote it (``train.batch-size``);
    the location of a value's error may hold the union member it failed against, left out."""
    if error["type"] == "extra_forbidden":
        return ".".join(map(str, error["loc"]))
    return ".".join(str(p) for p in error["loc"] if not (isinstance(p, str) and _UNION_MEMBER.search(p)))


def _quote_hint(key: str, value: Any) -> str:
    """How to give ``key`` the string a user meant where YAML read a boolean or a number."""
    if isinstance(value, bool) or value in ("true", "false"):
        return (f"; YAML reads yes, no, on, off, true and false as booleans: quote the value to keep it a "
                f"string, --set '{key}=\"...\"' or {key.split('.')[-1]}: \"...\" in the file")
    # the text as typed, not the number: YAML reads 0123 as 83 and 1_000 as 1000
    return (f"; YAML reads the value as the number {value}: quote it as you wrote it to keep it a string, "
            f"--set '{key}=\"...\"' or {key.split('.')[-1]}: \"...\" in the file")


def validation_problems(err: pydantic.ValidationError, model: type[BaseModel], prefix: str = "",
                        unknown: str = "key", listed: str = "every key: configs/README.md") -> dict[str, list[str]]:
    """``{key: [what is wrong, ...]}`` of ``err``, an error validating ``model`` (the whole config, or
    a method's parameters under ``prefix``): keys as a user writes them, the members of a union
    each saying what they take (the caller joins them), a check that names the field it refused
    keyed by that field, a "did you mean" for an unknown key (``unknown``: what it is called;
    ``listed``: where every one is, or ""), and how to quote a string that YAML read as a number or
    a boolean."""
    problems: dict[str, list[str]] = {}
    for e in err.errors():
        key = _error_key(e)
        msg = e["msg"].removeprefix("Value error, ")
        # a section's own check names the field it refused: "rounds: expects ..." at train
        field, _, rest = msg.partition(": ")
        section = _model_at(key.split(".") if key else [], model)
        keyed = bool(rest) and section is not None and field in section.model_fields
        if keyed:
            key, msg = f"{key}.{field}" if key else field, rest
        full = ".".join(filter(None, [prefix, key]))          # as the user writes it
        if keyed and msg.startswith(("expects a string, got ", "expects a string or null, got ")):
            msg += _quote_hint(full, msg.rpartition("got ")[2])
        if e["type"] == "extra_forbidden":
            parent = _model_at(key.split(".")[:-1], model)
            near = did_you_mean(key.split(".")[-1], parent.model_fields if parent else [])
            if not near and parent is AlgorithmConfig:     # a method's own parameter one level too high
                near = f" (a method's own parameters go under algorithm.params: algorithm.params.{key.split('.')[-1]})"
            msg = f"unknown {unknown}{near}{'; ' + listed if listed else ''}"
        elif e["type"] in ("model_type", "model_attributes_type", "dict_type"):
            msg = (f"expects a mapping of settings, got {e['input']!r:.60}; a setting inside it is written "
                   f"{key}.<setting> in --set, or `{key.split('.')[-1]}: {{<setting>: value}}` in YAML")
        elif e["type"] == "string_type" and isinstance(e["input"], (bool, int, float)):
            msg += _quote_hint(full, e["input"])
        elif e["type"] == "string_type" and isinstance(e["input"], (datetime.date, datetime.time)):
            msg += (f"; YAML reads {e['input']} as a date or time: quote it to keep it a string, --set "
                    f"'{full}=\"{e['input']}\"' or {full.split('.')[-1]}: \"{e['input']}\" in the file")
        elif e["type"] == "list_type" and isinstance(e["input"], (str, int, float)):
            msg += (f"; a list is written in brackets, even of one item: --set '{full}=[{e['input']}]' or "
                    f"{full.split('.')[-1]}: [{e['input']}] in the file")
        elif e["input"] is None and e["type"].endswith(("_type", "_parsing")):
            msg += (f"; YAML reads an empty value, ~ and null as null: give {full} a value, or leave the key out "
                    "for its default")
        problems.setdefault(full, []).append(msg)
    return problems


def _format_validation_error(err: pydantic.ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    lines += [f"  {key}: {'; or '.join(msgs)}" if key else f"  {'; '.join(msgs)}"
              for key, msgs in validation_problems(err, ExperimentConfig).items()]
    return "\n".join(lines)


def parse_value(text: str, key: str = "") -> Any:
    """A ``--set`` value: parsed as YAML so numbers, booleans and lists work (``k=[a,b]``)."""
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--set {key}={text}: the value is not valid YAML ({problem}); close brackets and "
                          "quotes, e.g. --set 'model.arch=[cnn2, cnn2]', or quote a plain string: "
                          f"--set '{key}=\"{text}\"'") from None
    refuse_glued_colon(value, f"--set {key}={text}")
    return value


def _model_at(parts: list[str], root: type[BaseModel] = ExperimentConfig) -> type[BaseModel] | None:
    """The section of the schema ``root`` that the key ``parts`` names (``root`` for none; train,
    data.local_test, ...): a mapping of settings each with its own default; None for one value
    (such as algorithm.params) or a key the schema does not have."""
    model: Any = root
    for part in parts:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        kinds = [a for a in (field.annotation, *getattr(field.annotation, "__args__", ())) if isinstance(a, type)]
        model = next((k for k in kinds if issubclass(k, Strict)), None)
    return model


def _is_section(parts: list[str]) -> bool:
    """Whether the key ``parts`` names a section of the schema (see :func:`_model_at`)."""
    return _model_at(parts) is not None


def split_override(assignment: str) -> tuple[str, str]:
    """A ``--set key=value`` item's key (stripped) and value text (``("run.threads", "1")``)."""
    key, _, value = assignment.partition("=")
    return key.strip(), value


def override_key(assignment: str) -> str:
    """The key of a ``--set key=value`` item (``run.threads`` of ``run.threads=1``)."""
    return split_override(assignment)[0]


def apply_override(raw: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, value = split_override(assignment)
    parts = key.split(".")
    if not all(p.strip() for p in parts):
        raise ConfigError(f"--set {assignment!r}: the key {key!r} has an empty name; give section.key, e.g. "
                          "--set train.rounds=5")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} holds {child!r} where the config (or an earlier --set) gives "
                              f"it, not a section of settings (a mapping): write {part} as one, e.g. "
                              f"`{part}: {{{parts[i + 1]}: ...}}`")
        node = child
    new = parse_value(value, key)
    old = node.get(parts[-1])
    if isinstance(new, dict) and isinstance(old, dict) and _is_section(parts):
        dropped = sorted(str(k) for k in set(old) - set(new))
        if dropped:
            # the section would be replaced whole: the keys the config set and the value leaves out
            # would go back to their defaults without a word
            example = next(iter(new), "rounds")
            raise ConfigError(f"--set {key}={value.strip()} would replace the whole {key} section, putting "
                              f"{', '.join(dropped)} (set in the config) back to {'its default' if len(dropped) == 1 else 'their defaults'}; set the keys one by "
                              f"one instead, e.g. --set {key}.{example}=... (from Python: {{'{key}.{example}': ...}})")
    node[parts[-1]] = new


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                raw: dict | None = None) -> ExperimentConfig:
    origin = str(path) if path else ("the config given" if raw is not None else "overrides")
    if overrides and (path or raw is not None):
        given = ", ".join(overrides)
        origin += f" with the overrides {given if len(given) <= 160 else given[:157] + '...'}"
    if raw is None:
        raw = {}
        if path is not None:
            p = Path(path)
            raw = read_yaml(p, "config file")
            if raw is None:
                raise ConfigError(f"config file {p} is empty; start from configs/quickstart.yaml (every key and "
                                  "its default: configs/README.md)")
            if not isinstance(raw, dict):
                raise ConfigError(f"{p} must hold a mapping of sections (data, model, algorithm, train, ...)")
    before = copy.deepcopy(raw) if overrides and isinstance(raw.get("paper"), dict) else None
    named_for = _named_for_its_method(raw)
    for assignment in overrides or []:
        apply_override(raw, assignment)
    if named_for and _named_for_its_method(raw) is None and raw.get("name") == named_for[0]:
        new_method = (raw.get("algorithm") or {}).get("name")
        warnings.warn(f"the run is named {named_for[0]!r}, after the method {named_for[1]!r} its config names, and runs "
                      f"{new_method!r}: compare and sweep tables would file its runs under {named_for[1]}'s name; "
                      f"--set name=... to tell them apart", UserWarning, stacklevel=2)
    if before is not None and isinstance(raw.get("paper"), dict):
        changed = _changed_settings(before, raw)
        if changed:
            raw["paper"] = {**raw["paper"], "changed": sorted({*raw["paper"].get("changed", []), *changed})}
    try:
        return ExperimentConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin)) from None


# Keys that may differ between a run's checkpoint and its config on resume: how the run is
# carried out, not what it computes (engines, devices and layouts are equivalent to float rounding, so a
# run stopped on a lent GPU may go on on a CPU; threads change speed only).
RESUMABLE_CHANGES = ("run.progress", "run.threads", "run.deterministic", "run.workers", "run.engine", "run.device",
                     "run.memory_format", "run.cuda_graphs",
                     "run.keep_graphs", "run.client_state", "run.client_state_store", "run.client_state_memory_mb",
                     "run.checkpoint_every", "run.out_dir", "run.loggers",
                     "run.mlflow_tracking_uri")


def check_resume_settings(run_settings: list[str] | None) -> None:
    """``--set`` items a resumed run takes: how it is carried out (:data:`RESUMABLE_CHANGES` but
    ``run.out_dir``: the folder it goes on in is the one resumed) and ``train.rounds`` (raised: the
    checkpoint check refuses fewer); ConfigError naming the others."""
    allowed = (*(k for k in RESUMABLE_CHANGES if k != "run.out_dir"), "train.rounds")
    keys = list(map(override_key, run_settings or []))
    if "run.out_dir" in keys:       # recorded as a setting of how a run is carried out, yet the folder is given
        raise ConfigError("--set run.out_dir: a resumed run goes on in the folder it is resumed from; to go on "
                          "elsewhere, copy that folder there and resume the copy")
    fixed = [k for k in keys if k not in allowed]
    for key in fixed:                  # a misspelt key is named as one, not as a change of the run
        parts = key.split(".")
        for i, part in enumerate(parts):
            section = _model_at(parts[:i])
            if section is None:        # inside one value (algorithm.params...): any key
                break
            if part not in section.model_fields:
                near = difflib.get_close_matches(part, list(section.model_fields), n=1)
                hint = f" (did you mean {'.'.join([*parts[:i], near[0]])}?)" if near else ""
                raise ConfigError(f"--set {key}: unknown key{hint}; every key: configs/README.md")
    if fixed:
        raise ConfigError(f"a resumed run takes --set only for how it is carried out ({', '.join(allowed)}); "
                          f"{', '.join(fixed)} would change what it computes: start a new run for that")


# Mappings that are one value each: compared and recorded whole (a method's or partitioner's own keys).
OPAQUE_SECTIONS = ("algorithm.params", "data.partition", "model.options")


def _named_for_its_method(raw: dict) -> tuple[str, str] | None:
    """``(name, method)`` where a raw config's name holds its method's name (``quickstart-fedrema``)."""
    name, algorithm = raw.get("name"), raw.get("algorithm")
    method = algorithm.get("name") if isinstance(algorithm, dict) else None
    if isinstance(name, str) and isinstance(method, str) and method and method.lower() in name.lower():
        return name, method
    return None


# What a paper's number does not depend on: how a run is carried out and evaluated, its seed and
# name, where its data is read from; train.rounds is compared with the paper's own T.
_NOT_THE_PAPERS_SECTIONS = ("run.", "eval.", "paper.")
_NOT_THE_PAPERS_KEYS = ("name", "seed", "data.root", "data.download", "data.verify", "train.rounds")


def _changed_settings(before: dict, after: dict) -> list[str]:
    """The settings (``section.key``, into algorithm.params) that differ between two raw configs,
    but for :data:`_NOT_THE_PAPERS_SECTIONS` and :data:`_NOT_THE_PAPERS_KEYS`."""
    a, b = flatten_config(before, opaque=()), flatten_config(after, opaque=())
    return sorted(k for k in set(a) | set(b) if a.get(k, _MISSING) != b.get(k, _MISSING)
                  and not (k.startswith(_NOT_THE_PAPERS_SECTIONS) or k in _NOT_THE_PAPERS_KEYS))


_MISSING = object()


def flatten_config(d: dict, prefix: str = "", opaque: tuple[str, ...] = OPAQUE_SECTIONS) -> dict[str, Any]:
    """A dumped config as ``{"train.lr": 0.01, ...}``; the ``opaque`` sections stay dicts."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in opaque:
            out.update(flatten_config(v, key + ".", opaque))
        else:
            out[key] = v
    return out


def config_changes(recorded: dict, current: ExperimentConfig) -> list[str]:
    """Keys whose value differs between a recorded config (``model_dump(mode="json")``) and
    ``current``, leaving out :data:`RESUMABLE_CHANGES`, the ``paper`` section (a note, not a
    setting) and a raised ``train.rounds`` (extending a run). A key the recorded config does not have (made before the key existed) counts as
    unchanged while the current value is its default. Each entry reads ``key: old -> new``."""
    old, new = flatten_config(recorded), flatten_config(current.model_dump(mode="json"))
    defaults = flatten_config(ExperimentConfig().model_dump(mode="json"))
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b or key in RESUMABLE_CHANGES or key == "paper" or key.startswith("paper."):
            continue
        if key not in old and key in defaults and b == defaults[key]:
            continue
        if key == "train.rounds" and isinstance(a, int) and isinstance(b, int) and b >= a:
            continue
        if key == "algorithm.params" and _same_params(new.get("algorithm.name"), old.get("algorithm.name"), a, b):
            continue                 # a default stated, or left out: the method reads the same values
        changes.append(f"{key}: {a!r} -> {b!r}")
    return changes


def params_alike(params_type: type[BaseModel], recorded: dict, current: dict | BaseModel) -> bool:
    """Whether ``recorded`` (a method's parameters as dumped) and ``current`` are the same values
    once ``params_type`` fills in its defaults: a default stated or left out, a key added since
    (it takes its default) and a set's order are no difference; values it refuses are one."""
    try:
        return params_type.model_validate(recorded) == (
            current if isinstance(current, BaseModel) else params_type.model_validate(current))
    except ValueError:            # pydantic's ValidationError
        return False


def _same_params(name: Any, recorded_name: Any, a: Any, b: Any) -> bool:
    """Whether two ``algorithm.params`` mappings of method ``name`` are alike (:func:`params_alike`).
    Reached only where the mappings differ as written, so the method's class (and torch) is loaded
    only then; False where it cannot be loaded."""
    if name != recorded_name or not isinstance(a, dict) or not isinstance(b, dict) or not isinstance(name, str):
        return False
    try:
        from fedhet.algorithms import algorithm_class

        params_type = algorithm_class(name).Params
    except (FedhetError, ValueError, ImportError):   # not loadable here: a change, as written
        return False
    return params_alike(params_type, a, b)


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
