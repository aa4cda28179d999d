"""The vectorized engine's schedule (engine/vectorized/schedule.py) and graph decisions
(engine/vectorized/graphs.py) on small hand-computed cases: pure functions of the clients' batches."""

from __future__ import annotations

import torch

from fedhet.engine.vectorized.graphs import CAPTURE, EAGER, GraphBook, count_actions, graphable, step_kind
from fedhet.engine.vectorized.schedule import plan


def streams(sizes: list[list[int]]):
    """Per client, batches of the given sizes whose positions are 0, 1, ... in order."""
    out = []
    for client in sizes:
        batches, start = [], 0
        for b in client:
            batches.append((torch.arange(start, start + b), None))
            start += b
        out.append(iter(batches))
    return out


# Three clients, batch size 2: n = 5 -> [2, 2, 1], n = 4 -> [2, 2], n = 3 -> [2, 1].
SIZES = [[2, 2, 1], [2, 2], [2, 1]]
TRAIN_IDX = [torch.tensor([10, 11, 12, 13, 14]), torch.tensor([20, 21, 22, 23]), torch.tensor([30, 31, 32])]


def test_buckets_group_the_clients_by_their_next_batch_size_largest_first():
    s = plan(streams(SIZES), TRAIN_IDX, wide=False, min_repeats=4)
    assert [(st.members, st.size, st.iteration, st.wide) for st in s.steps] == [
        ([0, 1, 2], 2, 0, False),      # everyone's first full batch in lockstep
        ([0, 1], 2, 1, False),         # client 2's remainder splits it off
        ([2], 1, 1, False),
        ([0], 1, 2, False),            # client 0's remainder, alone
    ]
    assert s.iterations == 3
    # rows in step order, each client's positions mapped into the shared pool
    assert s.positions.tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 4]
    assert s.pool_rows.tolist() == [10, 11, 20, 21, 30, 31, 12, 13, 22, 23, 32, 14]
    assert s.partial_members.tolist() == [0, 1, 2, 0]       # the narrow steps that leave a client out
    assert s.active is None and s.draws == {} and s.draw_rows == [None] * 4


def test_wide_steps_take_the_whole_group_with_a_stand_in_row():
    # size 2 is used by two steps of at least half the group (3 and 2 of 3 clients): wide at min_repeats=2
    s = plan(streams(SIZES), TRAIN_IDX, wide=True, min_repeats=2)
    assert [(st.members, st.size, st.wide, st.row_clients) for st in s.steps] == [
        ([0, 1, 2], 2, True, [0, 1, 2]),
        ([0, 1], 2, True, [0, 1, None]),       # client 2 computes on a stand-in batch
        ([2], 1, False, [2]),
        ([0], 1, False, [0]),
    ]
    assert s.active is not None and s.active.tolist() == [[True, True, True], [True, True, False]]
    # the stand-in row of client 2: positions 0, 1 (arange(2) % 3), its own pool rows
    assert s.pool_rows.tolist()[6:12] == [12, 13, 22, 23, 30, 31]
    assert s.partial_members.tolist() == [2, 0]
    # a step of fewer than half the group stays narrow even at a wide size
    four = plan(streams([[2, 2, 2], [2], [2], [2]]), [torch.arange(6)] + [torch.arange(2)] * 3, wide=True,
                min_repeats=1)
    assert [(st.members, st.wide) for st in four.steps] == [([0, 1, 2, 3], True), ([0], False), ([0], False)]
    # a size used by wide-eligible steps fewer than min_repeats times stays narrow
    assert not any(st.wide for st in plan(streams(SIZES), TRAIN_IDX, wide=True, min_repeats=3).steps)


def test_augmentation_draws_are_laid_out_flat_in_step_order():
    draws = [iter([(torch.arange(2), {"lam": torch.tensor([0.5, 0.25])})]),
             iter([(torch.arange(2), {"lam": torch.tensor([0.75, 1.0])})])]
    s = plan(draws, [torch.arange(2), torch.arange(2)], wide=False, min_repeats=4)
    assert s.draws["lam"].tolist() == [0.5, 0.25, 0.75, 1.0]
    assert s.draw_rows == [{"lam": (0, (2,))}]


def test_a_kind_runs_eagerly_once_then_is_captured_then_replays():
    book = GraphBook()
    kind = step_kind(3, 32, wide=False)
    assert kind == (3, 32) and step_kind(2, 32, wide=True) == ("wide", 32)
    assert book.action(kind, graphable=False) == EAGER
    assert book.action(kind, graphable=True) == EAGER
    book.eager_once.add(kind)
    assert book.action(kind, graphable=True) == CAPTURE


def test_graphable_needs_min_repeats_for_narrow_kinds_only():
    book = GraphBook()
    book.kind_counts[(2, 8)] = 3
    assert not graphable((2, 8), book, min_repeats=4)
    assert graphable((2, 8), book, min_repeats=3)
    assert graphable(("wide", 8), book, min_repeats=100)


def test_count_actions_over_a_schedule():
    # 2 clients of 4 full batches each (n = 8, B = 2): one kind (2, 2), four times
    s = plan(streams([[2, 2, 2, 2], [2, 2, 2, 2]]), [torch.arange(8), torch.arange(8)], wide=False, min_repeats=4)
    counts = count_actions(GraphBook(), s.steps, min_repeats=4, batch_size=2)
    assert counts == {"eager, full batch": 1, CAPTURE: 1, "replay, narrow": 3}
    # below min_repeats, every step runs eagerly; a remainder batch counts as one
    s = plan(streams([[2, 1], [2, 1]]), [torch.arange(3), torch.arange(3)], wide=False, min_repeats=4)
    counts = count_actions(GraphBook(), s.steps, min_repeats=4, batch_size=2)
    assert counts == {"eager, full batch": 1, "eager, remainder batch": 1}
    # a kept book goes on replaying across groups of one signature
    book = GraphBook()
    for _ in range(2):
        s = plan(streams([[2, 2, 2, 2], [2, 2, 2, 2]]), [torch.arange(8), torch.arange(8)], wide=False, min_repeats=4)
        counts = count_actions(book, s.steps, min_repeats=4, batch_size=2)
    assert counts == {"replay, narrow": 4}
