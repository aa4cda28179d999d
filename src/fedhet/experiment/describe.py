"""What ``fedhet list`` prints: the catalogue of methods, datasets, partitions and models, and
one of them described by its name (a method's or partition's parameters, a model's options, a
dataset's shape and where to get it), each as text built from the code's own signatures,
parameter declarations and docstrings."""

from __future__ import annotations

import inspect

from fedhet.core.errors import ConfigError

# What a user may call each list (the plural is the list's own name)
CATEGORIES = {"algorithms": "algorithms", "algorithm": "algorithms", "methods": "algorithms", "method": "algorithms",
              "datasets": "datasets", "dataset": "datasets", "partitions": "partitions", "partition": "partitions",
              "models": "models", "model": "models"}


def _plain_doc(text: str) -> str:
    """A docstring's first line without reStructuredText's double backquotes."""
    first = (text or "").strip().split("\n")[0].replace("``", "")
    return first or "(no docstring)"


def one_line(cls, limit: int = 100) -> str:
    """What a method is, from its docstrings: the class's first sentence where it describes a variant
    of the module's method (``Name: ...``) or where the class is a user's (outside fedhet: one of its
    modules may hold several methods), else the module's first paragraph."""
    own = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
    users = own and not cls.__module__.startswith("fedhet.")
    text = own if users or ":" in own.split(". ")[0] else " ".join(
        (inspect.getmodule(cls).__doc__ or "").split("\n\n")[0].split())
    text = text.split(". ")[0].rstrip(".").replace("``", "") or "(no docstring)"
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def _param_bounds(metadata) -> str:
    """A parameter's bounds from its ``Field(gt=..., le=...)``: ``> 0, < 1``."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return ", ".join(f"{sign} {getattr(m, key)}" for m in metadata for key, sign in signs.items()
                     if getattr(m, key, None) is not None)


def describe_method(name: str) -> list[str]:
    """One method's parameters (``algorithm.params``): type, bounds, default and the method that
    declares each (a FedAvg-family method inherits FedAvg's)."""
    from fedhet.algorithms import algorithm_class
    from fedhet.core.settings import type_name

    cls = algorithm_class(name)
    parts = [p.strip() for p in name.split("+")]
    what = (one_line(cls, limit=200) if len(parts) == 1 else
            f"the composition of {', '.join(parts)} (fedhet list on each part describes it)")
    lines = [f"{name}: {what}"]
    fields = cls.Params.model_fields
    if not fields:
        return [*lines, "no parameters (algorithm.params stays empty)"]
    lines.append("parameters (algorithm.params.NAME in a config, or --set algorithm.params.NAME=VALUE):")
    rows = []
    for param, field in fields.items():
        # the method whose Params declares it last (a combination's own Params only gathers its parts')
        owner = next((base.__qualname__.removesuffix(".Params") for base in cls.Params.__mro__
                      if base.__qualname__.endswith(".Params") and param in base.__dict__.get("__annotations__", {})),
                     "")
        kind = ", ".join(filter(None, [type_name(field.annotation), _param_bounds(field.metadata)]))
        rows.append((param, kind, repr(field.get_default(call_default_factory=True)), owner))
    rows.sort(key=lambda row: row[3] == "FedAvg")     # the method's own first, FedAvg's inherited ones last
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return lines + [f"  {param:<{widths[0]}}  {kind:<{widths[1]}}  default {default:<{widths[2]}}  ({owner})"
                    for param, kind, default, owner in rows]


def describe_partition(kind: str) -> list[str]:
    """A partition's first docstring line and its parameters (those after labels, num_clients and
    rng), each with its default or "required"."""
    from fedhet.data.federated import NATURAL_OPTIONS
    from fedhet.data.partition import PARTITIONS

    where = "parameters (data.partition.NAME in a config, or --set data.partition.NAME=VALUE):"
    if kind == "natural":
        return ["natural: one client per writer of the data (FEMNIST's writers, or the clients_train ids of data of "
                "your own), data.num_clients of them drawn at random", where,
                *(f"  {name}  default 0  ({what})" for name, what in NATURAL_OPTIONS.items())]
    fn = PARTITIONS[kind]
    return [f"{kind}: {_plain_doc(fn.__doc__ or '')}", where, *_parameters(fn, skip=3)]


def _parameters(fn, skip: int) -> list[str]:
    """``fn``'s parameters after the first ``skip``, each with its annotation and its default or "required"."""
    lines: list[str] = []
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):       # a builtin or C callable: no signature to read
        return ["  (its signature cannot be read)"]
    for p in list(signature.parameters.values())[skip:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind_name = "" if p.annotation is p.empty else (
            p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", ""))
        default = "required" if p.default is p.empty else f"default {p.default!r}"
        lines.append("  " + "  ".join(filter(None, [p.name, kind_name, default])))
    return lines


def describe_own(spec: str) -> list[str]:
    """A name of one's own that is no method: data given by path, or a function (a model builder,
    a partition or a data function) with its parameters."""
    from fedhet.core.plugins import describe as what_it_is
    from fedhet.core.plugins import load_object

    source = spec.split(":", 1)[0]
    if source in ("npz", "folder"):
        return [f"{spec}: data of your own ({'arrays in an .npz file' if source == 'npz' else 'a folder of images per class'}), "
                "read when a run starts (data.dataset); what it must hold: docs/extending.md"]
    try:
        obj = load_object(spec)
    except ValueError as e:
        raise ConfigError(f"fedhet list {spec}: {e}") from None
    if not callable(obj) or isinstance(obj, type):
        raise ConfigError(f"fedhet list {spec}: it is {what_it_is(obj)}; a name of your own is a method (MODULE:CLASS "
                          "of a subclass of fedhet.extend.FedAvg), or a model builder, partition or data function "
                          "(MODULE:FUNCTION)")
    return [f"{spec}: {_plain_doc(obj.__doc__ or '')}",
            "a function of yours: as a model builder (model.arch) it is called with in_channels, num_classes, "
            "image_size and model.options; as a partition (data.partition.kind) with labels, num_clients, rng "
            "and the section's other keys; as data (data.dataset) with the split. Its parameters:",
            *_parameters(obj, skip=0)]


def describe_model(name: str) -> list[str]:
    from fedhet.models import describe_model as model_facts

    d = model_facts(name)
    lines = [f"{name}: {_plain_doc(d['doc'])}",
             f"head from stage {d['split']} on by default (model.split to move it)"
             + ("; model.norm: bn (default) or gn" if d["norm"] else
                "; no normalisation layer (model.norm does not apply)")]
    if not d["options"]:
        return [*lines, "no options (model.options stays empty)"]
    return [*lines, "options (model.options.NAME in a config, or --set model.options.NAME=VALUE):",
            *(f"  {option}  default {default!r}" for option, default in d["options"].items())]


def describe_dataset(name: str) -> list[str]:
    from fedhet.data.datasets import data_search_dirs, dataset_info, how_to_get

    info = dataset_info(name)
    side = info["image_size"]
    return [f"{name}: {info['num_classes']} classes, {info['in_channels']}x{side}x{side} images",
            f"looked for in: data.root/{name} and data.root where a config sets data.root, then "
            + ", ".join(str(d) for d in data_search_dirs(name, None)),
            f"to get it: {how_to_get(name)}"]


def describe(name: str) -> str:
    """``fedhet list NAME``: the method, model, dataset or partition kind of that name (a name that
    is none of these is read as a method: a combination, or MODULE:CLASS of one's own)."""
    from fedhet.algorithms import ALGORITHMS, Algorithm
    from fedhet.core.plugins import is_import_path, load_object
    from fedhet.data.datasets import DATASET_NAMES
    from fedhet.data.partition import PARTITIONS
    from fedhet.models import MODEL_NAMES

    if name not in ALGORITHMS:
        for names, describer in ((MODEL_NAMES, describe_model), (DATASET_NAMES, describe_dataset),
                                 ((*PARTITIONS, "natural"), describe_partition)):
            if name in names:
                return "\n".join(describer(name))
        if name in CATEGORIES:
            raise ConfigError(f"fedhet list NAME describes the method, model, dataset or partition kind of that "
                              f"name, and {name} is none: fedhet list, without a NAME, lists the {CATEGORIES[name]}")
        if "+" not in name and (name.startswith(("npz:", "folder:")) or is_import_path(name)):
            own = None if name.startswith(("npz:", "folder:")) else _loaded(load_object, name)
            if not (isinstance(own, type) and issubclass(own, Algorithm)):
                return "\n".join(describe_own(name))
    return "\n".join(describe_method(name))


def _loaded(load_object, spec: str):
    try:
        return load_object(spec)
    except ValueError:
        return None               # describe_method says why, as a run would


def catalogue() -> str:
    """``fedhet list``: every built-in method (with what it is), dataset, partition kind and model."""
    from fedhet.algorithms import ALGORITHMS
    from fedhet.data.datasets import DATASET_NAMES
    from fedhet.data.partition import PARTITIONS
    from fedhet.models import MODEL_NAMES

    width = max(map(len, ALGORITHMS))
    return "\n".join([
        "algorithms (algorithm.name; combine FedAvg-family ones with '+', e.g. fedprox+fedfm):",
        *(f"  {name:<{width}}  {one_line(ALGORITHMS[name])}" for name in sorted(ALGORITHMS)),
        "  your own method: MODULE:CLASS (docs/extending.md)",
        "  a method's parameters and their defaults: fedhet list METHOD (also a partition, model or dataset)",
        "datasets:   " + ", ".join(DATASET_NAMES) + "; your own: npz:PATH, folder:PATH, MODULE:FUNCTION",
        "partitions: " + ", ".join(sorted(PARTITIONS)) + ", natural; your own: MODULE:FUNCTION",
        "models:     " + ", ".join(MODEL_NAMES) + "; your own: MODULE:BUILDER",
    ])
