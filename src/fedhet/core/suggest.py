"""The "did you mean" of an unknown name: one rule for every catalogue (methods, models, datasets,
partitions, config keys, metrics)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, names: Iterable[str], cutoff: float = 0.6) -> str:
    """``" (did you mean NAME?)"`` for the name of ``names`` nearest ``word`` (case aside), or ``""``."""
    near = difflib.get_close_matches(str(word).lower(), list(names), n=1, cutoff=cutoff)
    return f" (did you mean {near[0]}?)" if near else ""
