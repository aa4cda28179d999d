"""The schedule of a group: which clients step together at each iteration, with which batches.

Unequal local step counts and batch sizes use buckets, not padding: each client walks its own
batch sequence (the exact batches the reference draws), and at every iteration the clients are
bucketed by the size of their next batch; each bucket is one vmapped step over the stacked slices
of its members. Padding would change what opaque loss terms and BatchNorm compute (the mean over
a padded batch, batch statistics); buckets keep every client's arithmetic that of the reference.
A client whose steps are done takes no step; clients of equal size and the full batches of unequal
ones move in lockstep, only the remainder batches (``n % B``) of each epoch may run as small extra
buckets.

With ``wide`` (where CUDA graphs replay), a step of at least half the group at a batch size that
such steps use at least ``min_repeats`` times runs at the group's full width: the clients outside
it compute on a stand-in batch and keep their state (the step's ``active`` mask). All such steps
then replay one graph, where each new set of members would otherwise be a new step kind: one
client's remainder batch splits the others off into such a set, and so does each client that
finishes before the rest. The stand-in rows are wasted work, counted as ``idle_rows``.

:func:`plan` is pure: it depends on the clients' batches only, not on what training computes, so
the whole schedule goes to the device in one transfer per tensor and the loop sends nothing from
the host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

Draws = dict[str, torch.Tensor] | None
ClientBatch = tuple[torch.Tensor, Draws]         # (positions in the client's data, augmentation draws)


@dataclass
class Step:
    members: list[int]               # the clients (group rows) that take this step
    size: int                        # their batch size
    iteration: int                   # every client with steps left takes one per iteration
    wide: bool                       # run at the group's full width, with an active mask
    row_clients: list[int | None]    # the client of each row (None: a wide step's stand-in row)

    @property
    def width(self) -> int:
        return len(self.row_clients)


@dataclass
class Schedule:
    """A group's steps with their inputs laid out flat, in step order (host tensors)."""

    steps: list[Step]
    iterations: int
    positions: torch.Tensor          # every row's batch positions, concatenated
    pool_rows: torch.Tensor          # the same rows as indices into the shared data pool
    partial_members: torch.Tensor    # the members of the narrow steps that leave a client out
    active: torch.Tensor | None      # (wide steps, C) bool: which rows are the step's clients
    draws: dict[str, torch.Tensor]   # per draw name, every row's draws flattened
    draw_rows: list[dict[str, tuple[int, tuple]] | None]   # per step: name -> (offset, per-row shape)


def bucket_steps(streams: list[Iterator[ClientBatch]]) -> tuple[list[tuple[list[int], int, int, list]], int]:
    """(members, size, iteration, their batches) per step, largest batch size first within an
    iteration, and the number of iterations."""
    upcoming = [next(it, None) for it in streams]
    steps: list[tuple[list[int], int, int, list]] = []
    iteration = 0
    while True:
        buckets: dict[int, list[int]] = {}
        for i, nxt in enumerate(upcoming):
            if nxt is not None:
                buckets.setdefault(len(nxt[0]), []).append(i)
        if not buckets:
            break
        for size in sorted(buckets, reverse=True):
            members = buckets[size]
            steps.append((members, size, iteration, [upcoming[i] for i in members]))
            for i in members:
                upcoming[i] = next(streams[i], None)
        iteration += 1              # every client with steps left took exactly one this iteration
    return steps, iteration


def plan(streams: list[Iterator[ClientBatch]], train_idx: list[torch.Tensor], wide: bool,
         min_repeats: int) -> Schedule:
    """The schedule of a group whose client ``i`` draws ``streams[i]`` and whose data pool indices
    are ``train_idx[i]``; ``wide``: whether recurring steps of half the group or more run at full
    width (see the module docstring)."""
    C = len(streams)
    steps, iterations = bucket_steps(streams)
    wide_sizes: set[int] = set()
    if wide:
        wide_count = Counter(size for members, size, _, _ in steps if 2 * len(members) >= C)
        wide_sizes = {b for b, k in wide_count.items() if k >= min_repeats}
    planned: list[Step] = []
    positions: list[torch.Tensor] = []
    pool_rows: list[torch.Tensor] = []
    partial: list[int] = []
    masks: list[list[bool]] = []
    # The augmentations' draws, per name all in one flat tensor (one transfer each): a step's
    # rows are (offset, per-row shape) into it.
    draw_parts: dict[str, list[torch.Tensor]] = {}
    draw_rows: list[dict[str, tuple[int, tuple]] | None] = []
    offsets: dict[str, int] = {}
    for members, size, it, batch in steps:
        is_wide = size in wide_sizes and 2 * len(members) >= C
        if is_wide:
            mine = dict(zip(members, batch))
            some = batch[0][1]
            rows_batch = []
            for i in range(C):
                # a stand-in for a client outside the step: positions it has, results unused
                rows_batch.append(mine[i] if i in mine else (
                    torch.arange(size) % len(train_idx[i]),
                    None if some is None else {k: torch.zeros_like(v) for k, v in some.items()}))
            row_clients: list[int | None] = [i if i in mine else None for i in range(C)]
            masks.append([i is not None for i in row_clients])
        else:
            if len(members) < C:
                partial.extend(members)
            rows_batch, row_clients = batch, list(members)
        for i, (p, _) in enumerate(rows_batch):      # row i of a wide step is client i
            client = i if is_wide else members[i]
            positions.append(p)
            pool_rows.append(train_idx[client][p])
        meta = None
        if rows_batch[0][1] is not None:
            meta = {}
            for name, first in rows_batch[0][1].items():
                meta[name] = (offsets.get(name, 0), tuple(first.shape))
                flat = [d[name].reshape(-1) for _, d in rows_batch]      # type: ignore[index]
                draw_parts.setdefault(name, []).extend(flat)
                offsets[name] = offsets.get(name, 0) + sum(len(f) for f in flat)
        draw_rows.append(meta)
        planned.append(Step(members, size, it, is_wide, row_clients))
    return Schedule(planned, iterations, torch.cat(positions), torch.cat(pool_rows),
                    torch.tensor(partial, dtype=torch.long), torch.tensor(masks, dtype=torch.bool) if masks else None,
                    {name: torch.cat(parts) for name, parts in draw_parts.items()}, draw_rows)
