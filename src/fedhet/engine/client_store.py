"""The clients' persistent states (SCAFFOLD's control variates, a personalized method's own
parameters, kept optimizer moments) in bounded memory.

:class:`ClientStates` is the round loop's ``client_states``: a dict of client id -> state that
keeps the most recently written states in memory up to a byte budget and writes the others to
disk, one file per state, leaving a placeholder (:class:`Spilled`) in their place. Reading a
spilled state loads its file (the state stays on disk; it is normally replaced after the round
that read it). ``mode``: ``memory`` never spills (a plain dict; this class's default, while a run's
``run.client_state_store`` defaults to ``auto``), ``disk`` spills every state as soon as it is
written, ``auto`` spills only beyond ``memory_budget`` bytes.

Format: each state is one file written by ``torch.save`` and read back with
``torch.load(weights_only=True)``: torch's own zip serialization, which holds the nested dicts,
lists, tensors and plain values that methods keep, without running code on load and with no
dependency beyond torch. One file per state means a write touches that client alone; states are
tens of kB to tens of MB, for which a file system is a good key-value store.

A state must load with ``weights_only=True``: tensors, Python numbers, strings, None, and dicts,
lists and tuples of them (in ``disk`` and ``auto`` mode a numpy value is refused as soon as a
method returns it, with the key that holds it).

Checkpoints: a file is never rewritten. A state written again gets a new file (a version number
in its name), so the files a checkpoint names stay valid until the next checkpoint is on disk:
:meth:`ClientStates.snapshot` returns the states in memory plus the names of the spilled files
(not their content: a checkpoint does not copy the store); once the checkpoint is saved,
:meth:`ClientStates.commit` deletes the files that neither the current states nor that checkpoint
name (a run killed while saving keeps the previous checkpoint's files). :meth:`ClientStates.restore`
brings back a snapshot's states and deletes files written after it. The budget is per process.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch

from fedhet.core.choices import StoreMode
from fedhet.core.contract import State, to_device
from fedhet.core.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Spilled:
    """Where a state spilled to disk lives, and its size. It is read back onto the CPU (the client
    host moves a state to its device for each job)."""

    file: str
    nbytes: int
    floats: int


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


def _refuse_unloadable(obj: Any, where: str) -> None:
    """Raise ConfigError at the first value of ``obj`` that ``torch.load(weights_only=True)`` refuses."""
    # exact types: a numpy float is a float subclass that torch.load(weights_only=True) refuses
    if isinstance(obj, torch.Tensor) or obj is None or type(obj) in (bool, int, float, str):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _refuse_unloadable(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _refuse_unloadable(v, f"{where}[{i}]")
        return
    raise ConfigError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}: a client state written to "
                      f"disk may hold tensors, Python numbers, strings, None and dicts, lists and tuples of them. "
                      f"Store it as one of those (e.g. a tensor, or float(x) for a numpy scalar), or keep the states "
                      f"in memory with run.client_state_store: memory")


def physical_memory() -> int:
    """Bytes of RAM of this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cgroup_memory_limit() -> int:
    """This process's container memory limit in bytes (cgroup v2 or v1), 0 where there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:       # v1 writes a huge number for "no limit"
            return int(text)
    return 0


def default_budget() -> int:
    """A quarter of the memory this process may use (the machine's RAM, or its container's limit
    where lower): the rest is for the data, the models and the engine."""
    available = [m for m in (physical_memory(), cgroup_memory_limit()) if m > 0]
    return min(available) // 4 if available else 4 << 30


class ClientStates(dict):
    """client id -> state, spilled to ``folder`` beyond ``memory_budget`` bytes (module docstring).

    A dict, so code that reads states (``[cid]``, ``get``, ``items``, ``values``, ``dict(store)``)
    sees them as before; a spilled state is loaded for each read.
    """

    def __init__(self, folder: str | os.PathLike | None = None, mode: StoreMode = "memory",
                 memory_budget: int | None = None):
        super().__init__()
        if mode not in get_args(StoreMode):
            raise ValueError(f"client state store mode must be one of {', '.join(get_args(StoreMode))}, not {mode!r}")
        if mode != "memory" and folder is None:
            raise ValueError(f"a client state store in mode {mode!r} needs a folder to spill to")
        self.mode = mode
        self.folder = Path(folder) if folder is not None else None
        # disk: a budget below any state's size (0 bytes included), so every state spills as it is set
        self.memory_budget = -1 if mode == "disk" else (memory_budget if memory_budget is not None else default_budget())
        self._in_memory: OrderedDict[int, int] = OrderedDict()     # cid -> bytes, least recently written first
        self._memory_bytes = 0
        self._version = 0
        self._kept: set[str] = set()         # files the last saved checkpoint or the pending snapshot names
        self._pending: set[str] = set()      # files the snapshot being saved names
        self.counters = {"spilled": 0, "loaded": 0}
        self.seconds = 0.0                   # spent in reads and writes: bookkeeping, spilling, loading

    def info(self) -> dict[str, Any]:
        """What a run's summary says of its store (``client_states``)."""
        return {"mode": self.mode, "states": len(self), "spilled_now": self.spilled(), **self.counters,
                "seconds": round(self.seconds, 3)}

    # --- the dict interface -----------------------------------------------------------
    def __getitem__(self, cid: int) -> State:
        start = time.perf_counter()
        value = super().__getitem__(cid)
        if isinstance(value, Spilled):
            value = self._load(value)
        self.seconds += time.perf_counter() - start
        return value

    def get(self, cid: int, default: Any = None) -> Any:       # type: ignore[override]
        return self[cid] if cid in self else default

    def __iter__(self) -> Any:
        # A dict subclass with its own __iter__ makes dict(store) and {**store} read it through
        # keys() and __getitem__ (loading spilled states) instead of copying the placeholders.
        return iter(list(dict.keys(self)))

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == (dict(other.items()) if isinstance(other, ClientStates) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __ior__(self, other: Any) -> ClientStates:      # type: ignore[override,misc]
        self.update(other)
        return self

    def __or__(self, other: Any) -> dict[int, State]:    # type: ignore[override]
        return dict(self.items()) | dict(other)

    def popitem(self) -> tuple[int, State]:
        if not self:
            raise KeyError("popitem(): the client state store is empty")
        cid = list(dict.keys(self))[-1]
        return cid, self.pop(cid)

    def clear(self) -> None:
        for cid in list(dict.keys(self)):
            del self[cid]

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
        if isinstance(state, Spilled):
            raise TypeError("a Spilled placeholder is not a client state")
        start = time.perf_counter()
        self._forget(cid)
        super().__setitem__(cid, state)
        if self.mode != "memory":
            # checked as the method returns it, not hours later when the budget first spills it
            _refuse_unloadable(state, f"client {cid}'s state")
            nbytes, _ = state_size(state)
            self._in_memory[cid] = nbytes
            self._memory_bytes += nbytes
            while self._in_memory and self._memory_bytes > self.memory_budget:
                oldest, size = self._in_memory.popitem(last=False)
                self._memory_bytes -= size
                super().__setitem__(oldest, self._spill(oldest, super().__getitem__(oldest)))
        self.seconds += time.perf_counter() - start

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
        # every state that can spill was checked when it was set (__setitem__)
        nbytes, floats = state_size(state)
        if self._version == 0:          # a store restored in a new process: after every file there
            self._version = self._highest_version()
        self._version += 1
        name = f"{cid}-{self._version}.pt"
        tmp = self._path(name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        torch.save(to_device(state, "cpu"), tmp)
        os.replace(tmp, self._path(name))
        self.counters["spilled"] += 1
        return Spilled(name, nbytes, floats)

    def _highest_version(self) -> int:
        if self.folder is None or not self.folder.exists():
            return 0
        versions = [int(m.group(1)) for p in self.folder.iterdir() if (m := re.fullmatch(r"\d+-(\d+)\.pt", p.name))]
        return max(versions, default=0)

    def _load(self, entry: Spilled) -> State:
        self.counters["loaded"] += 1
        return torch.load(self._path(entry.file), map_location="cpu", weights_only=True)

    # --- checkpoints -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint holds: in ``memory`` mode the states themselves (on the CPU), as it
        always has; otherwise the states in memory and the spilled files' names."""
        start = time.perf_counter()
        try:
            return self._snapshot()
        finally:
            self.seconds += time.perf_counter() - start

    def _snapshot(self) -> dict[str, Any]:
        if self.mode == "memory":
            self._pending = set()           # the checkpoint holds every state itself
            return to_device(dict(super().items()), "cpu")
        memory = {cid: to_device(v, "cpu") for cid, v in super().items() if not isinstance(v, Spilled)}
        spilled = {cid: v for cid, v in super().items() if isinstance(v, Spilled)}
        self._pending = {v.file for v in spilled.values()}
        self._kept |= self._pending         # until commit(): the previous checkpoint's files stay too
        return {"store": "client_states", "version": self._version, "memory": memory,
                "spilled": {cid: (v.file, v.nbytes, v.floats) for cid, v in spilled.items()}}

    def commit(self) -> None:
        """The last :meth:`snapshot` is saved: the files only earlier checkpoints named may go."""
        self._kept = set(self._pending)
        self._collect()

    def restore(self, snap: dict[Any, Any]) -> None:
        """The states of ``snap`` (a :meth:`snapshot`, or a plain dict of states from a checkpoint
        written without a store)."""
        self._drop_all()
        if snap.get("store") != "client_states":       # a plain dict of states
            for cid, state in snap.items():
                self[cid] = state
            return
        spilled = {cid: Spilled(name, nbytes, floats) for cid, (name, nbytes, floats, *_) in snap["spilled"].items()}
        for cid, entry in spilled.items():
            if self.folder is None or not self._path(entry.file).exists():
                raise CheckpointError(f"the checkpoint names client {cid}'s state file {entry.file} in "
                                      f"{self.folder}, which is gone: the run's client_states folder was "
                                      f"changed or removed, so the run cannot resume from this checkpoint")
        self._kept = {e.file for e in spilled.values()}
        self._pending = set(self._kept)
        self._version = max(self._version, snap["version"], self._highest_version())
        if self.mode == "memory":       # a run resumed with run.client_state_store: memory
            for cid, entry in spilled.items():
                self[cid] = self._load(entry)
        else:
            for cid, entry in spilled.items():
                dict.__setitem__(self, cid, entry)
        for cid, state in snap["memory"].items():
            self[cid] = state
        self._collect()

    def _drop_all(self) -> None:
        dict.clear(self)
        self._in_memory.clear()
        self._memory_bytes = 0

    def _collect(self) -> None:
        """Delete the files that neither the current states nor a checkpoint still on disk name."""
        if self.folder is None or not self.folder.exists():
            return
        live = {v.file for v in super().values() if isinstance(v, Spilled)} | self._kept
        for path in self.folder.glob("*.pt*"):
            if path.name not in live:
                path.unlink(missing_ok=True)
