"""One check for every settings model (a config section, a method's parameters): values that pydantic
would quietly read as something else.

pydantic reads ``true`` as 1 for an int or float field (``rounds: true`` would run one round,
``mu: true`` FedProx with mu 1), and accepts ``.inf``/``.nan`` for a float, which surfaces much later
as a non-finite loss blamed on the learning rate.
"""

from __future__ import annotations

import math
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo


def refuse_quiet_values(fields: dict[str, FieldInfo], data: Any) -> Any:
    """``data`` unchanged, or a ValueError naming the first field given a boolean where its type
    takes none, or a float that is not finite. For a pydantic ``model_validator(mode="before")``."""
    if isinstance(data, dict):
        for name, field in fields.items():
            value = data.get(name)
            if isinstance(value, bool) and not accepts_bool(field.annotation):
                raise ValueError(f"{name}: expects {type_name(field.annotation)}, got {str(value).lower()}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name}: expects a finite number, got {value}")
    return data


def accepts_bool(annotation: Any) -> bool:
    """Whether a field's type admits True/False as such (bool, Any, or a union or Literal with them)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    return any(accepts_bool(a) for a in get_args(annotation))


def type_name(annotation: Any) -> str:
    """A field's type as a config's reader says it: ``a number``, ``a string or null``."""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        kinds = [type_name(a) for a in get_args(annotation) if a is not type(None)]
        nullable = type(None) in get_args(annotation)
        return " or ".join(dict.fromkeys(kinds)) + (" or null" if nullable else "")
    names = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}
    return names.get(annotation, f"a {getattr(annotation, '__name__', annotation)}")
