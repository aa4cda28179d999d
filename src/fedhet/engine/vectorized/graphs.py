"""CUDA graphs: which recurring steps of a group replay a captured graph, and the capture itself.

Steps that recur - as many clients with the same batch size, e.g. all of them with full batches,
or the clients left once the smallest have finished - replay one CUDA graph per kind: a wide step
(:mod:`.schedule`) one per batch size, a narrow step one per (number of members, batch size). The
first step of a kind runs eagerly (it creates the statistics' totals and warms up cuDNN), the
second is captured and replayed, the rest replay it with their inputs copied in. A narrow kind
that recurs fewer than ``GRAPH_MIN_REPEATS`` times in the schedule is not worth a capture. The
arithmetic of a replay is the eager step's; a failed capture leaves that kind's steps eager.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedhet.engine.vectorized.schedule import Step

# A narrow step kind is captured only if the group's schedule has it this often: its first step
# runs eagerly, the capture costs about one more plus the graph's instantiation, and each replay
# saves most of an eager step (the host's Python and kernel launches). benchmarks/graph_schedule.py
# counts what a value does to a run's eager steps and captures, on the CPU.
GRAPH_MIN_REPEATS = 4

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


@dataclass
class GraphBook:
    """A group's CUDA graphs by step kind, the kinds that have run eagerly, how often each narrow
    kind has occurred, and the memory pool its graphs share."""

    graphs: dict[tuple, GraphedStep] = field(default_factory=dict)
    eager_once: set[tuple] = field(default_factory=set)
    kind_counts: Counter = field(default_factory=Counter)
    pool: Any = None             # the memory pool handle its graphs share

    def action(self, kind: tuple, graphable: bool) -> str:
        """What a step of ``kind`` does now: run eagerly, be captured (then replayed), or replay."""
        if not graphable:
            return EAGER
        graph = self.graphs.get(kind)
        if graph is not None:
            return REPLAY if graph.ok else EAGER
        return CAPTURE if kind in self.eager_once else EAGER


def step_kind(members: int, size: int, wide: bool) -> tuple:
    """The graph a step replays: one per batch size for wide steps, per (members, size) otherwise."""
    return ("wide", size) if wide else (members, size)


def graphable(kind: tuple, book: GraphBook, min_repeats: int) -> bool:
    """Whether steps of ``kind`` are worth a graph: every wide kind, a narrow one that recurs."""
    return kind[0] == "wide" or book.kind_counts[kind] >= min_repeats


StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class GraphedStep:
    """One recurring step of a group (as many members, the same batch size) captured as a CUDA graph.

    Everything the step reads or writes lives at a fixed address for the group's life: the
    stacked weights, momentum buffers and statistics' totals (updated in place), the loss terms'
    constants, the device data pool, and input buffers that :meth:`replay` fills before each
    launch: the batch's pool indices and positions, for a narrow step its members' rows (``idx``),
    for a full-width step (``wide``) also which of the group's clients
    the step is for, and with an augmentation the step's draws. The losses and parts it returns are
    copies of the graph's outputs.
    ``ok`` is False, with ``error`` set, when capturing failed."""

    def __init__(self, step: StepFn, book: GraphBook, device: torch.device, width: int, size: int,
                 idx: torch.Tensor | None, wide: bool = False, draws: dict[str, torch.Tensor] | None = None):
        dev = device
        self.pool_idx = torch.zeros((width, size), dtype=torch.long, device=dev)
        self.pos = torch.zeros((width, size), dtype=torch.long, device=dev)
        self.idx = None if idx is None else idx.clone()     # the members' rows, filled at each replay
        self.active = torch.ones(width, dtype=torch.bool, device=dev) if wide else None
        # the augmentation's draws of the step (same shapes at every step of this kind)
        self.draws = None if draws is None else {k: torch.zeros_like(v) for k, v in draws.items()}
        self.graph = torch.cuda.CUDAGraph()
        self.ok, self.error = True, ""
        # Captured on a stream of our own: the outer context restores the thread's stream even when
        # torch.cuda.graph's exit raises (it ends the capture before it restores the stream), so
        # a failed capture cannot leave later eager steps on the capture stream.
        current = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(current)
        try:
            # One memory pool for all of a group's graphs: each step's intermediates are dead once it
            # has run and its outputs are copied out of the graph at once (replay), so graphs
            # replayed in any order may reuse the same memory; a pool per graph would hold every
            # graph's activations at once (large models).
            with torch.cuda.stream(side), torch.cuda.graph(self.graph, stream=side, pool=book.pool):
                self.losses, self.parts = step(self.idx, self.pool_idx, self.pos, self.active, self.draws)
            if book.pool is None:
                book.pool = self.graph.pool()
        except Exception as e:  # noqa: BLE001 - counted by the engine; these steps go on eagerly
            self.ok, self.error = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            torch.cuda.synchronize(dev)
        finally:
            current.wait_stream(side)

    def replay(self, pool_idx: torch.Tensor, pos: torch.Tensor, active: torch.Tensor | None = None,
               draws: dict[str, torch.Tensor] | None = None,
               idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool_idx.copy_(pool_idx)
        self.pos.copy_(pos)
        if self.idx is not None:
            assert idx is not None
            self.idx.copy_(idx)
        if self.active is not None:
            assert active is not None
            self.active.copy_(active)
        if self.draws is not None:
            assert draws is not None
            for k, t in self.draws.items():
                t.copy_(draws[k])
        self.graph.replay()
        return self.losses.clone(), self.parts.clone()


def narrow_kinds(steps: list[Step]) -> Counter:
    """How often each narrow step kind occurs in a schedule (``GraphBook.kind_counts`` adds them
    up before the group trains: whether a kind is worth a graph depends on the whole schedule)."""
    return Counter(step_kind(len(s.members), s.size, s.wide) for s in steps if not s.wide)


def count_actions(book: GraphBook, steps: list[Step], min_repeats: int, batch_size: int) -> Counter:
    """What a CUDA run with graphs would do with ``steps``, nothing computed: the eager steps, the
    captures and the replays (steps at ``batch_size`` are full batches, the others remainders; a capture counts as one replay too, as the engine replays a graph as
    soon as it is captured). Updates ``book`` as the engine would, with every capture succeeding."""
    book.kind_counts.update(narrow_kinds(steps))
    counts: Counter = Counter()
    for s in steps:
        kind = step_kind(len(s.members), s.size, s.wide)
        action = book.action(kind, graphable(kind, book, min_repeats))
        if action == CAPTURE:
            book.graphs[kind] = _Counted()          # type: ignore[assignment]
            counts[CAPTURE] += 1
            action = REPLAY
        if action == REPLAY:
            counts["replay, full width" if s.wide else "replay, narrow"] += 1
        else:
            book.eager_once.add(kind)
            counts["eager, full batch" if s.size == batch_size else "eager, remainder batch"] += 1
    return counts


class _Counted:
    """A graph that :func:`count_actions` pretends to have captured."""

    ok = True
