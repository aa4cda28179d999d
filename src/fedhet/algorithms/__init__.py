"""Registry of federated methods by config name; combining them (`fedprox+scaffold`) is in composition.py."""

from __future__ import annotations

import warnings

from fedhet.algorithms.base import Algorithm
from fedhet.algorithms.composition import compose
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
from fedhet.algorithms.ktpfl_weight import KTpFLWeight
from fedhet.algorithms.local_only import LocalOnly
from fedhet.algorithms.moon import Moon
from fedhet.algorithms.perfedavg import PerFedAvg
from fedhet.algorithms.scaffold import Scaffold
from fedhet.core.errors import ConfigError
from fedhet.core.plugins import describe, is_import_path, load_object
from fedhet.core.suggest import did_you_mean

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedAvg, LocalOnly, FedProx, FedAvgM, Scaffold, FedDyn, FedNova, Moon, FedRS, FedCME, FedFM, FedFMLite,
                           FedACD, FedACDBase, FedLC, FedROD, FedNTD, FedNH, FedDecorr, CReFF, FedClassAvg, KTpFL,
                           KTpFLWeight,
                           FedReMa,
                           PerFedAvg, FedBABU, FedDistill, FedPer, FedRep, FedProto, FedPAC)
}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def _user_method(spec: str) -> type[Algorithm]:
    """The method class an import path (``mylab.methods:FedFoo``) names, checked."""
    try:
        obj = load_object(spec)
    except ValueError as e:
        raise ConfigError(f"{spec!r}: {e}") from e.__cause__    # a module that raised on import: its traceback
    if not (isinstance(obj, type) and issubclass(obj, Algorithm)):
        raise ConfigError(f"{spec!r} is {describe(obj)}, not a method: a method is a subclass of "
                          "fedhet.extend.FedAvg (or fedhet.extend.Algorithm), see docs/extending.md")
    if "name" not in vars(obj):
        raise ConfigError(f"{spec!r}: the class has no name of its own (it inherits {obj.name!r}, so its runs "
                          f"would be reported as that method); give it one, e.g. name = {obj.__name__.lower()!r}")
    if ALGORITHMS.get(obj.name, obj) is not obj:
        raise ConfigError(f"{spec!r}: its name {obj.name!r} is the built-in method's, so its runs would be reported "
                          f"as that method's; give it a name of its own, e.g. name = {obj.__name__.lower()!r}")
    _warn_of_misspelt_hooks(spec, obj)
    return obj


def _warn_of_misspelt_hooks(spec: str, cls: type[Algorithm]) -> None:
    """A method the class defines that no base class has, named like one that it has (``local_term``
    for ``local_terms``, ``agregate`` for ``aggregate``), is never called: the run would be its
    base method's, and nothing would say so."""
    inherited = {n for base in cls.__mro__[1:] for n, v in vars(base).items() if callable(v) and not n.startswith("_")}
    for name, value in vars(cls).items():
        if callable(value) and not name.startswith("_") and name not in inherited:
            near = did_you_mean(name, inherited, cutoff=0.85)
            if near:
                warnings.warn(f"{spec}: {cls.__name__}.{name} is no hook of {cls.__mro__[1].__name__}'s, so fedhet "
                              f"never calls it{near}", UserWarning, stacklevel=3)


def algorithm_class(name: str) -> type[Algorithm]:
    """The method a config names: a built-in name, an import path ``MODULE:CLASS`` of the user's own
    method, or several of either joined by ``+`` (composed, see :func:`compose`)."""
    parts = [p.strip() for p in name.split("+")]
    if len(parts) > 1 and not all(parts):
        raise ConfigError(f"algorithm {name!r}: a combination names a method on each side of every '+', e.g. "
                          "fedprox+fedfm")
    unknown = [p for p in parts if p not in ALGORITHMS and not is_import_path(p)]
    if unknown:
        raise ConfigError(f"unknown algorithm {unknown[0]!r}{did_you_mean(unknown[0], ALGORITHMS)}; "
                          f"available: {', '.join(sorted(ALGORITHMS))} "
                          f"(combine FedAvg-family methods with '+', e.g. fedprox+scaffold; a method of your own: "
                          f"MODULE:CLASS, e.g. mylab.methods:FedFoo)")
    classes = [_user_method(p) if is_import_path(p) else ALGORITHMS[p] for p in parts]
    if len(classes) == 1:
        return classes[0]
    return compose(classes)
