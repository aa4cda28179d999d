"""The clients' persistent states (SCAFFOLD's control variates, a personalized method's own
parameters, kept optimizer moments) in bounded memory.

:class:`ClientStates` is the round loop's ``client_states``: a dict of client id -> state that
keeps the most recently written states in memory up to a byte budget and writes the others to
disk, one file per state, leaving a placeholder (:class:`Spilled`) in their place. Reading a
spilled state loads its file (the state stays on disk; it is normally replaced after the round
that read it). ``mode``: ``memory`` never spills (a plain dict; today's behaviour), ``disk`` spills
every state as soon as it is written, ``auto`` spills only beyond ``memory_budget`` bytes.

Format: each state is one file written by ``torch.save`` and read back with
``torch.load(weights_only=True)``: torch's own zip serialization, which holds the nested dicts,
lists, tensors and plain values that methods keep, without running code on load and with no
dependency beyond torch. One file per state means a write touches that client alone; states are
tens of kB to tens of MB, for which a file system is a good key-value store.

Checkpoints: a file is never rewritten. A state written again gets a new file (a version number
in its name), so the files a checkpoint names stay valid until the next checkpoint:
:meth:`ClientStates.snapshot` returns the states in memory plus the names of the spilled files
(not their content: a checkpoint does not copy the store), and marks those files as the ones to
keep; files that neither the current states nor the last snapshot name are deleted.
:meth:`ClientStates.restore` brings back a snapshot's states and deletes files written after it.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from fedhet.core.contract import State, to_device

StoreMode = Literal["auto", "memory", "disk"]


@dataclass(frozen=True)
class Spilled:
    """Where a state spilled to disk lives, its size and the device it is read back onto."""

    file: str
    nbytes: int
    floats: int
    device: str


def state_size(obj: Any) -> tuple[int, int]:
    """(bytes, elements) of every tensor inside ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), obj.numel()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        sizes = [state_size(v) for v in obj]
        return sum(b for b, _ in sizes), sum(n for _, n in sizes)
    return 0, 0


def _device_of(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return str(obj.device)
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return next((d for d in (_device_of(v) for v in values) if d != "cpu"), "cpu")


def physical_memory() -> int:
    """Bytes of RAM of this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_budget() -> int:
    """A quarter of the machine's RAM: the rest is for the data, the models and the engine."""
    return physical_memory() // 4 or 4 << 30


class ClientStates(dict):
    """client id -> state, spilled to ``folder`` beyond ``memory_budget`` bytes (module docstring).

    A dict, so code that reads states (``[cid]``, ``get``, ``items``, ``values``) sees them as
    before; a spilled state is loaded for each read.
    """

    def __init__(self, folder: str | os.PathLike | None = None, mode: StoreMode = "memory",
                 memory_budget: int | None = None):
        super().__init__()
        if mode not in ("auto", "memory", "disk"):
            raise ValueError(f"client state store mode must be auto, memory or disk, not {mode!r}")
        if mode != "memory" and folder is None:
            raise ValueError(f"a client state store in mode {mode!r} needs a folder to spill to")
        self.mode = mode
        self.folder = Path(folder) if folder is not None else None
        self.memory_budget = 0 if mode == "disk" else (memory_budget if memory_budget is not None else default_budget())
        self._in_memory: OrderedDict[int, int] = OrderedDict()     # cid -> bytes, least recently written first
        self._memory_bytes = 0
        self._version = 0
        self._kept: set[str] = set()         # files the last snapshot names
        self.counters = {"spilled": 0, "loaded": 0}

    # --- the dict interface -----------------------------------------------------------
    def __getitem__(self, cid: int) -> State:
        value = super().__getitem__(cid)
        return self._load(value) if isinstance(value, Spilled) else value

    def get(self, cid: int, default: Any = None) -> Any:       # type: ignore[override]
        return self[cid] if cid in self else default

    def values(self) -> list[State]:          # type: ignore[override]
        return [self[cid] for cid in list(self.keys())]

    def items(self) -> list[tuple[int, State]]:   # type: ignore[override]
        return [(cid, self[cid]) for cid in list(self.keys())]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for cid, state in dict(*args, **kwargs).items():
            self[cid] = state

    def setdefault(self, cid: int, default: Any = None) -> Any:
        if cid not in self:
            self[cid] = default
        return self[cid]

    def copy(self) -> dict[int, State]:              # type: ignore[override]
        return dict(self.items())

    def __setitem__(self, cid: int, state: State) -> None:
        self._forget(cid)
        nbytes, _ = state_size(state)
        super().__setitem__(cid, state)
        if self.mode == "memory":
            return
        self._in_memory[cid] = nbytes
        self._memory_bytes += nbytes
        while self._in_memory and self._memory_bytes > self.memory_budget:
            oldest, size = self._in_memory.popitem(last=False)
            self._memory_bytes -= size
            super().__setitem__(oldest, self._spill(oldest, super().__getitem__(oldest)))

    def __delitem__(self, cid: int) -> None:
        self._forget(cid)
        super().__delitem__(cid)

    def pop(self, cid: int, *default: Any) -> Any:             # type: ignore[override]
        if cid not in self:
            if default:
                return default[0]
            raise KeyError(cid)
        value = self[cid]
        del self[cid]
        return value

    def __reduce__(self) -> tuple[Any, ...]:
        # a copy or a pickle of the store is a plain dict of its states (checkpoints hold snapshot())
        return dict, (dict(self.items()),)

    # --- bookkeeping ----------------------------------------------------------------
    def tensor_floats(self) -> int:
        """Elements of every state's tensors, spilled ones included (without loading them)."""
        total = 0
        for value in super().values():
            total += value.floats if isinstance(value, Spilled) else state_size(value)[1]
        return total

    def memory_bytes(self) -> int:
        """Bytes of the states held in memory (0 in ``memory`` mode, which does not count them)."""
        return self._memory_bytes

    def spilled(self) -> int:
        """How many states are on disk now."""
        return sum(isinstance(v, Spilled) for v in super().values())

    def _forget(self, cid: int) -> None:
        """Drop ``cid``'s current entry: its memory count, or its file unless the last snapshot names it."""
        if not super().__contains__(cid):
            return
        if cid in self._in_memory:
            self._memory_bytes -= self._in_memory.pop(cid)
        value = super().__getitem__(cid)
        if isinstance(value, Spilled) and value.file not in self._kept:
            self._path(value.file).unlink(missing_ok=True)

    def _path(self, name: str) -> Path:
        assert self.folder is not None
        return self.folder / name

    def _spill(self, cid: int, state: State) -> Spilled:
        nbytes, floats = state_size(state)
        self._version += 1
        name = f"{cid}-{self._version}.pt"
        tmp = self._path(name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        torch.save(to_device(state, "cpu"), tmp)
        os.replace(tmp, self._path(name))
        self.counters["spilled"] += 1
        return Spilled(name, nbytes, floats, _device_of(state))

    def _load(self, entry: Spilled) -> State:
        self.counters["loaded"] += 1
        return torch.load(self._path(entry.file), map_location=entry.device, weights_only=True)

    # --- checkpoints -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds: in ``memory`` mode the states themselves (on the CPU), as it
        always has; otherwise the states in memory and the spilled files' names."""
        if self.mode == "memory":
            return to_device(dict(super().items()), "cpu")
        memory = {cid: to_device(v, "cpu") for cid, v in super().items() if not isinstance(v, Spilled)}
        spilled = {cid: v for cid, v in super().items() if isinstance(v, Spilled)}
        self._kept = {v.file for v in spilled.values()}
        self._collect()
        return {"store": "client_states", "version": self._version, "memory": memory,
                "spilled": {cid: (v.file, v.nbytes, v.floats, v.device) for cid, v in spilled.items()}}

    def restore(self, snap: dict[Any, Any]) -> None:
        """The states of ``snap`` (a :meth:`snapshot`, or a plain dict of states from a checkpoint
        written without a store)."""
        self._drop_all()
        if snap.get("store") != "client_states":       # a plain dict of states
            for cid, state in snap.items():
                self[cid] = state
            return
        for cid, (name, nbytes, floats, device) in snap["spilled"].items():
            if not self._path(name).exists():
                raise FileNotFoundError(f"the checkpoint names client {cid}'s state file {self._path(name)}, "
                                        f"which is gone: the run's client_states folder was changed or removed")
            dict.__setitem__(self, cid, Spilled(name, nbytes, floats, device))
        self._kept = {name for name, *_ in snap["spilled"].values()}
        self._version = max(self._version, snap["version"])
        for cid, state in snap["memory"].items():
            self[cid] = state
        self._collect()

    def _drop_all(self) -> None:
        dict.clear(self)
        self._in_memory.clear()
        self._memory_bytes = 0

    def _collect(self) -> None:
        """Delete the files that neither the current states nor the last snapshot name."""
        if self.folder is None or self.mode == "memory" or not self.folder.exists():
            return
        live = {v.file for v in super().values() if isinstance(v, Spilled)} | self._kept
        for path in self.folder.glob("*.pt*"):
            if path.name not in live:
                path.unlink(missing_ok=True)

    def close(self, remove: bool = False) -> None:
        """``remove``: delete the folder (a finished run keeps no spilled states)."""
        if remove and self.folder is not None and self.folder.exists() and self.mode != "memory":
            shutil.rmtree(self.folder, ignore_errors=True)
