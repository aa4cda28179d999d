"""Composition of methods (``fedprox+scaffold``): one class whose hooks chain through every component.

Each FedAvg hook of a component calls ``super()``, so the combination's hook runs every component's
part, left first (Python's MRO). A hook that does *not* call ``super()`` replaces what comes after it:
FedCME's ``client_update``, FedRS's ``data_terms``, FedRep's ``local_training``. That is how a
component takes over a step, and it is fine as long as no other component has a part in that step;
otherwise that part would silently never run. :func:`compose` refuses such a combination and names
the hook and both methods. The same holds for the hooks FedAvg's version of a hook calls: a hook
that replaces FedAvg's must call them (itself or through a helper of its own, as FedCME's
``client_update`` does) where another component defines one - a ``client_update`` its
``start_weights``, ``local_training``, ``after_training``, ``uploaded_model``, ``uploads`` and
``upload_scalars``, an ``aggregate`` its ``aggregation_weights`` (FedACD's scores) - and a hook it
skips takes that hook's own callees with it (a ``client_update`` without ``local_training`` cuts
off FedProx's ``local_terms`` unless it calls ``local_terms`` itself). Whether a hook calls
``super()`` is read from its source (a method of one's own is a class in a file, so its source is
there); a hook whose source cannot be read counts as replacing. A hook that calls ``super()`` on
some way through it counts as chaining: the built-in hooks that return without it on another way
do so for a case of their own, where no other component has a part (FedFM's anchor messages,
FedBABU's fine-tuning messages and fine-tuned models, Per-FedAvg's adapted models). Requiring the
call on every way through would refuse pairs of built-in methods that run every part, such as
``fedfm+fednova`` and ``fedfm+scaffold``, where the only way without it answers FedFM's anchor
message. A method of one's own that skips ``super()`` on a way where another component has a part
is not caught: call ``super()`` there.

Parts can also disagree on what travels or what is evaluated, whatever their hooks call. Class flags
on ``FedAvg`` (each explained where it is defined) say so, and a combination they contradict is
refused: a method that sends no global model (FedProto) beside one that reads it; one whose clients
train against the server's head (FedNH) beside one whose clients own theirs (FedPer, FedRep, FedPAC,
FedBABU); one that reads the averaged head (CReFF) named after one whose clients upload none; one
whose training spans two messages (FedCME) beside one whose client rule reads one message's
(SCAFFOLD, FedNova); and one whose ``client_model`` returns a model of its own making as it is
(Per-FedAvg, FedBABU) named before one whose ``client_model`` changes the evaluated model (FedROD).
An error names an order only where that order combines (``_composes``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

import pydantic

from fedhet.algorithms.base import Algorithm
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.errors import ConfigError


@functools.cache
def _hooks() -> tuple[str, ...]:
    """Every method a component may override: the functions FedAvg and Algorithm define."""
    names: dict[str, None] = {}
    for cls in (FedAvg, Algorithm):
        for name, value in vars(cls).items():
            if not name.startswith("__") and inspect.isfunction(_function(value)):
                names[name] = None
    return tuple(names)


def _function(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


@functools.cache
def _calls(fn: Any) -> frozenset[tuple[str, str]] | None:
    """The method calls in ``fn``'s body as (receiver, name): ``("super", "round")`` for
    ``super().round(...)``, ``("self", "local_training")`` for ``self.local_training(...)``;
    None when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
                found.add(("super", node.func.attr))
            elif isinstance(receiver, ast.Name) and receiver.id == "self":
                found.add(("self", node.func.attr))
    return frozenset(found)


def _reached(cls: type, fn: Any) -> frozenset[str]:
    """The names of the methods ``fn`` calls on ``self``, also through its own helpers (FedCME's
    ``client_update`` trains and uploads in ``final_update``); a hook it calls is not followed, as
    that hook's own calls are checked as its own."""
    seen: set[str] = set()
    todo = [fn]
    while todo:
        for receiver, name in _calls(todo.pop()) or ():
            if receiver != "self" or name in seen:
                continue
            seen.add(name)
            helper = _function(inspect.getattr_static(cls, name, None))
            if name not in _hooks() and inspect.isfunction(helper):
                todo.append(helper)
    return frozenset(seen)


def _chains(cls: type, fn: Any, hook: str) -> bool:
    """Whether ``fn`` (``cls``'s ``hook``) calls ``super().hook``, itself or through its own helpers
    on ``self`` (an ``aggregate`` that returns ``self._clipped(...)``, which calls the super's)."""
    seen: set[str] = set()
    todo = [fn]
    while todo:
        calls = _calls(todo.pop())
        if calls is None:
            continue
        if ("super", hook) in calls:
            return True
        for receiver, name in calls:
            helper = _function(inspect.getattr_static(cls, name, None))
            if receiver == "self" and name not in seen and name not in _hooks() and inspect.isfunction(helper):
                seen.add(name)
                todo.append(helper)
    return False


def _owner(cls: type, classes: list[type[Algorithm]]) -> str:
    return next(c.name for c in classes if cls in c.__mro__)


def _refuse_lost_hooks(name: str, classes: list[type[Algorithm]], combined: type) -> None:
    """Raise when one component's hook replaces (does not call ``super()``) a hook another component
    overrides, so that the other's part would never run."""
    mro = [k for k in combined.__mro__[1:] if k not in FedAvg.__mro__]

    def defines(k: type, hook: str) -> bool:
        return inspect.isfunction(_function(vars(k).get(hook)))

    def lost_to(k: type, definers: list[type]) -> list[tuple[type, str]]:
        """The definers whose part ``k`` cuts off, each with a component that relies on it."""
        out = []
        for d in definers:
            relying = [c for c in classes if d in c.__mro__ and k not in c.__mro__]
            if relying:
                out.append((d, relying[0].name))
        return out

    terminal: dict[str, type] = {}
    for hook in _hooks():
        definers = [k for k in mro if defines(k, hook)]
        for i, k in enumerate(definers):
            if _chains(k, vars(k)[hook], hook):
                continue
            terminal[hook] = k
            lost = lost_to(k, definers[i + 1:])
            if lost:
                (d, other), owner = lost[0], _owner(k, classes)
                hint = (f"; name {other} first (its {hook} calls super())"
                        if _chains(d, vars(d)[hook], hook) and _composes(_named_first(classes, next(c for c in classes if c.name == other))) else "")
                why = (f"does not call super().{hook}" if _calls(vars(k)[hook]) is not None
                       else f"has no source to read (counted as not calling super().{hook})")
                raise ConfigError(f"cannot combine {name}: {owner}'s {hook} {why}, so {other}'s {hook} would "
                                  f"never run{hint}")
            break
    # A hook that replaces FedAvg's must still call the hooks FedAvg's calls (client_update: start_weights,
    # local_training, uploaded_model, ...; aggregate: aggregation_weights) where another component defines
    # one; a hook it skips takes FedAvg's callees of that hook with it (no local_training: no local_terms).
    # global_model is left out: the evaluation calls it itself.
    for hook, k in terminal.items():
        own = _reached(combined, vars(k)[hook])
        readable = _calls(vars(k)[hook]) is not None
        skipped: list[str] = []
        todo = [hook]
        while todo:
            caller = todo.pop(0)
            callees = _calls(_function(getattr(FedAvg, caller))) or frozenset()
            for sub in sorted(sub for receiver, sub in callees if receiver == "self" and sub in _hooks()):
                if sub in own or sub in skipped or sub == "global_model":
                    continue
                skipped.append(sub)
                todo.append(sub)
                lost = lost_to(k, [d for d in mro if defines(d, sub)])
                if lost:
                    owner, other = _owner(k, classes), lost[0][1]
                    why = (f"has no source to read (counted as calling none of {hook}'s hooks)"
                           if not readable
                           else f"does not call {sub} as FedAvg's does" if caller == hook
                           else f"does not call {caller} (which calls {sub}) as FedAvg's does")
                    raise ConfigError(f"cannot combine {name}: {owner}'s {hook} {why}, so {other}'s {sub} would "
                                      "never run")


def compose(classes: list[type[Algorithm]]) -> type[Algorithm]:
    """One method whose hooks chain through every component (Python's MRO, left first).

    Each FedAvg hook calls ``super()``, so ``fedprox+scaffold`` trains on CE + proximal + control-variate
    terms, and a component that replaces the average (FedNova's ``average_models``) or the round
    (FedFM's anchor phase) supplies it for the combination, the others' server rules going on from
    it. Hyper-parameters of all components live in one ``algorithm.params`` mapping, so parts may not
    share a parameter name. A combination
    in which some component's part would never run is refused (module docstring).
    """
    for cls in classes:
        if not issubclass(cls, FedAvg):
            raise ConfigError(f"{cls.name!r} cannot be combined with other methods: only FedAvg-family methods "
                              "compose")
    name = "+".join(cls.name for cls in classes)
    for i, cls in enumerate(classes):
        for other in classes[i + 1:]:
            if other is cls:
                raise ConfigError(f"cannot combine {name}: it names {cls.name} twice")
            if issubclass(other, cls) or issubclass(cls, other):
                sub, base = (other, cls) if issubclass(other, cls) else (cls, other)
                raise ConfigError(f"cannot combine {name}: {sub.name} is built on {base.name} already; "
                                  f"name only {sub.name}")
    owner: dict[str, str] = {}
    for cls in classes:
        for field in set(cls.Params.model_fields) - set(FedAvg.Params.model_fields):
            if field in owner:
                raise ConfigError(f"cannot combine {name}: both {owner[field]} and {cls.name} have a parameter "
                                  f"{field!r}, each with its own meaning, and one algorithm.params.{field} cannot "
                                  "set the two; run them apart, or combine a method of your own whose parameter "
                                  "has another name (docs/extending.md)")
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
    # A component without parameters of its own (FedROD) has FedAvg's Params: a base of the others'
    bases = [p for p in dict.fromkeys(cls.Params for cls in classes)
             if not any(q is not p and issubclass(q, p) for q in (c.Params for c in classes))]
    params = pydantic.create_model(f"Params[{name}]", __base__=tuple(bases),
                                   **{field: (info.annotation, info) for field, (_, info) in changed.items()})
    try:
        combined = type(name.replace("+", "_"), tuple(classes), {"name": name, "Params": params})
    except TypeError as e:
        raise ConfigError(f"cannot combine {name}: {e}") from None
    weighers = [c.name for c in classes if c.aggregation_weights is not FedAvg.aggregation_weights]
    if len(weighers) > 1:
        raise ConfigError(f"cannot combine {name}: {weighers[0]} and {weighers[1]} each define the aggregation "
                          f"weights (only one would apply)")
    averagers = [c.name for c in classes if c.average_models is not FedAvg.average_models]
    if len(averagers) > 1:
        raise ConfigError(f"cannot combine {name}: {averagers[0]} and {averagers[1]} each define how the uploaded "
                          f"models are averaged (only one would apply)")
    owner_of_term = [c.name for c in classes if getattr(c, "builds_own_data_term", False)]
    replacers = [c.name for c in classes if c.data_terms is not FedAvg.data_terms]
    if owner_of_term and replacers:
        raise ConfigError(f"cannot combine {name}: {owner_of_term[0]} builds its own data term, which would "
                          f"silently drop {replacers[0]}'s replacement of the cross-entropy")
    _refuse_head_mismatch(name, classes)
    split = [c.name for c in classes if getattr(c, "trains_over_two_messages", False)]
    one = [c.name for c in classes if getattr(c, "reads_one_messages_training", False)]
    if split and one:
        raise ConfigError(f"cannot combine {name}: {split[0]}'s local training runs over two messages, and "
                          f"{one[0]}'s client rule reads the training of one; run them apart")
    no_model = [c.name for c in classes if not getattr(c, "sends_global_model", True)]
    readers = [c.name for c in classes if getattr(c, "sends_global_model", True)
               and not getattr(c, "reads_no_global_model", False)]
    if no_model and readers:
        able = sorted({c.name for c in _subclasses(FedAvg)
                       if vars(c).get("reads_no_global_model") and c.__module__.startswith(__package__ or "")})
        raise ConfigError(f"cannot combine {name}: {no_model[0]}'s clients receive no global model, and "
                          f"{readers[0]} reads the model they receive or the server averages; {no_model[0]} "
                          f"combines only with methods that read none ({', '.join(able)}, or one of your own "
                          "that says so with reads_no_global_model = True)")
    _refuse_lost_hooks(name, classes, combined)
    for i, cls in enumerate(classes):
        if getattr(cls, "evaluates_own_model", False):
            after = [c for c in classes[i + 1:] if any("client_model" in vars(k) for k in c.__mro__
                                                       if k not in FedAvg.__mro__ and k not in cls.__mro__)]
            if after:
                other = after[0]
                works = not getattr(other, "evaluates_own_model", False) and _composes(_named_first(classes, other))
                fix = f"name {other.name} first" if works else "run them apart (no order combines them)"
                raise ConfigError(f"cannot combine {name}: {cls.name}'s client_model evaluates a model of its own "
                                  f"making as it is, so {other.name}'s client_model would never change it; {fix}")
    return combined


_probing = False


def _composes(classes: list[type[Algorithm]]) -> bool:
    """Whether ``compose`` accepts this order, so that an error names an order only where one works
    (False while probing another order: two refusals that name each other's order end there)."""
    global _probing
    if _probing:
        return False
    _probing = True
    try:
        compose(classes)
    except ConfigError:
        return False
    finally:
        _probing = False
    return True


def _named_first(classes: list[type[Algorithm]], front: type[Algorithm]) -> list[type[Algorithm]]:
    """``classes`` (a combination's order) with ``front``, one of them, named first."""
    return [front, *(c for c in classes if c is not front)]


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def _refuse_head_mismatch(name: str, classes: list[type[Algorithm]]) -> None:
    """Refuse a combination whose parts disagree on where the head lives (FedAvg's head flags)."""
    on_server = [c.name for c in classes if getattr(c, "trains_on_server_head", False)]
    own = [c.name for c in classes if getattr(c, "clients_own_head", False)]
    if on_server and own:
        raise ConfigError(f"cannot combine {name}: {on_server[0]}'s clients train against the head the server keeps, "
                          f"and {own[0]}'s clients train with a head of their own, so {on_server[0]}'s head would "
                          f"never be the one they train against; run them apart")
    for i, cls in enumerate(classes):
        if getattr(cls, "reads_averaged_head", False):
            before = [c.name for c in classes[:i] if getattr(c, "uploads_no_head", False)]
            if before:
                raise ConfigError(f"cannot combine {name}: {cls.name}'s aggregate reads the averaged model's head, "
                                  f"which {before[0]}'s clients do not upload and {before[0]}'s aggregate puts back "
                                  f"only after the methods named after it; name {cls.name} first")
