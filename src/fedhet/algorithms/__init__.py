"""Registry of federated methods by config name, and composition (``fedprox+scaffold``)."""

from __future__ import annotations

from typing import Any

import pydantic

from fedhet.algorithms.base import Algorithm
from fedhet.algorithms.creff import CReFF
from fedhet.algorithms.fedacd import FedACD, FedACDBase
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedavgm import FedAvgM
from fedhet.algorithms.fedbabu import FedBABU
from fedhet.algorithms.fedclassavg import FedClassAvg
from fedhet.algorithms.fedcme import FedCME
from fedhet.algorithms.feddecorr import FedDecorr
from fedhet.algorithms.feddistill import FedDistill
from fedhet.algorithms.feddyn import FedDyn
from fedhet.algorithms.fedfm import FedFM, FedFMLite
from fedhet.algorithms.fedlc import FedLC
from fedhet.algorithms.fednh import FedNH
from fedhet.algorithms.fednova import FedNova
from fedhet.algorithms.fedntd import FedNTD
from fedhet.algorithms.fedpac import FedPAC
from fedhet.algorithms.fedper import FedPer
from fedhet.algorithms.fedproto import FedProto
from fedhet.algorithms.fedprox import FedProx
from fedhet.algorithms.fedrema import FedReMa
from fedhet.algorithms.fedrep import FedRep
from fedhet.algorithms.fedrod import FedROD
from fedhet.algorithms.fedrs import FedRS
from fedhet.algorithms.ktpfl import KTpFL
from fedhet.algorithms.local_only import LocalOnly
from fedhet.algorithms.moon import Moon
from fedhet.algorithms.perfedavg import PerFedAvg
from fedhet.algorithms.scaffold import Scaffold
from fedhet.core.errors import ConfigError
from fedhet.core.plugins import describe, is_import_path, load_object

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedAvg, LocalOnly, FedProx, FedAvgM, Scaffold, FedDyn, FedNova, Moon, FedRS, FedCME, FedFM, FedFMLite,
                           FedACD, FedACDBase, FedLC, FedROD, FedNTD, FedNH, FedDecorr, CReFF, FedClassAvg, KTpFL,
                           FedReMa,
                           PerFedAvg, FedBABU, FedDistill, FedPer, FedRep, FedProto, FedPAC)
}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def compose(classes: list[type[Algorithm]]) -> type[Algorithm]:
    """One method whose hooks chain through every component (Python's MRO, left first).

    Each FedAvg hook calls ``super()``, so ``fedprox+scaffold`` trains on CE + proximal + control-variate
    terms, and a component that replaces the server rule (FedNova's ``aggregate``) or the round
    (FedFM's anchor phase) supplies it for the combination. Hyper-parameters of all components
    live in one ``algorithm.params`` mapping, so parts may not share a parameter name.
    """
    for cls in classes:
        if not issubclass(cls, FedAvg):
            raise ConfigError(f"{cls.name!r} cannot be combined with other methods: only FedAvg-family methods "
                              "compose")
    name = "+".join(cls.name for cls in classes)
    owner: dict[str, str] = {}
    for cls in classes:
        for field in set(cls.Params.model_fields) - set(FedAvg.Params.model_fields):
            if field in owner:
                raise ConfigError(f"cannot combine {name}: both {owner[field]} and {cls.name} have a parameter "
                                  f"{field!r}")
            owner[field] = cls.name
    # A FedAvg parameter whose default a component changes (FedACD's mixup) keeps that component's
    # default in the combination, whichever side it is on; two components changing it differently clash.
    changed: dict[str, tuple[str, Any]] = {}
    for cls in classes:
        for field, info in cls.Params.model_fields.items():
            if field not in FedAvg.Params.model_fields or info.default == FedAvg.Params.model_fields[field].default:
                continue
            if field in changed and changed[field][1].default != info.default:
                raise ConfigError(f"cannot combine {name}: {changed[field][0]} and {cls.name} give the parameter "
                                  f"{field!r} different defaults; set it in algorithm.params")
            changed[field] = (cls.name, info)
    params = pydantic.create_model(f"Params[{name}]", __base__=tuple(cls.Params for cls in classes),
                                   **{field: (info.annotation, info) for field, (_, info) in changed.items()})
    try:
        combined = type(name.replace("+", "_"), tuple(classes), {"name": name, "Params": params})
    except TypeError as e:
        raise ConfigError(f"cannot combine {name}: {e}") from None
    weighers = [c.name for c in classes if c.aggregation_weights is not FedAvg.aggregation_weights]
    if len(weighers) > 1:
        raise ConfigError(f"cannot combine {name}: {weighers[0]} and {weighers[1]} each define the aggregation "
                          f"weights (only one would apply)")
    owner_of_term = [c.name for c in classes if getattr(c, "builds_own_data_term", False)]
    replacers = [c.name for c in classes if c.data_terms is not FedAvg.data_terms]
    if owner_of_term and replacers:
        raise ConfigError(f"cannot combine {name}: {owner_of_term[0]} builds its own data term, which would "
                          f"silently drop {replacers[0]}'s replacement of the cross-entropy")
    return combined


def _user_method(spec: str) -> type[Algorithm]:
    """The method class an import path (``mylab.methods:FedFoo``) names, checked."""
    try:
        obj = load_object(spec)
    except ValueError as e:
        raise ConfigError(f"{spec!r}: {e}") from None
    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        raise ConfigError(f"{spec!r} is {describe(obj)}, not a method: a method is a subclass of "
                          "fedhet.extend.FedAvg (or fedhet.extend.Algorithm), see docs/extending.md")
    if "name" not in vars(obj):
        raise ConfigError(f"{spec!r}: the class has no name of its own (it inherits {obj.name!r}, so its runs "
                          f"would be reported as that method); give it one, e.g. name = {obj.__name__.lower()!r}")
    return obj


def algorithm_class(name: str) -> type[Algorithm]:
    """The method a config names: a built-in name, an import path ``MODULE:CLASS`` of the user's own
    method, or several of either joined by ``+`` (composed, see :func:`compose`)."""
    parts = [p.strip() for p in name.split("+")]
    unknown = [p for p in parts if p not in ALGORITHMS and not is_import_path(p)]
    if unknown:
        raise ConfigError(f"unknown algorithm {unknown[0]!r}; available: {', '.join(sorted(ALGORITHMS))} "
                          f"(combine FedAvg-family methods with '+', e.g. fedprox+scaffold; a method of your own: "
                          f"MODULE:CLASS, e.g. mylab.methods:FedFoo)")
    classes = [_user_method(p) if is_import_path(p) else ALGORITHMS[p] for p in parts]
    if len(classes) == 1:
        return classes[0]
    return compose(classes)
