"""The transport: delivers a phase's jobs (each client in its own thread, :mod:`.baton`), serves
their train requests by group (:mod:`.grouping`) or on the reference path, and runs each group's
schedule (:mod:`.schedule`) step by step, eagerly (:mod:`.step`) or by replaying CUDA graphs
(:mod:`.graphs`), then unstacks the results (:mod:`.results`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from fedhet.engine.host import Job, JobResult, SimClient
from fedhet.engine.loop import Transport
from fedhet.engine.vectorized.baton import ClientTask, TrainRequest, VecClient
from fedhet.engine.vectorized.graphs import (
    CAPTURE,
    GRAPH_MIN_REPEATS,
    REPLAY,
    GraphedStep,
    graphable,
    narrow_kinds,
    step_kind,
)
from fedhet.engine.vectorized.grouping import OWN_LOOP, ZERO_STEPS, Group, KeptGroups, build_group, group_key
from fedhet.engine.vectorized.kernels import adam_table
from fedhet.engine.vectorized.results import unstack
from fedhet.engine.vectorized.schedule import ClientBatch, Schedule, plan
from fedhet.engine.vectorized.step import Pool, vmapped_step
from fedhet.training.augment import Augmentation
from fedhet.training.dropout import draw_masks
from fedhet.training.local import epoch_batches
from fedhet.training.precision import strict_fp32


def available() -> bool:
    """True where the vectorized engine is the better choice: a CUDA device is present."""
    return torch.cuda.is_available()


class Vectorized(Transport):
    """A transport that trains the clients of a phase together with ``vmap``.

    ``device``: default CUDA when available, else CPU. ``fallback_on_error=False`` makes a failing
    vmapped group raise instead of retrying on the reference path (the tests use it, so a
    vectorization bug cannot hide). ``cuda_graphs``: replay recurring steps as CUDA graphs (CUDA
    only). ``graph_min_repeats``: how often a narrow step kind must recur to be captured (the tests
    lower it so that their short schedules capture graphs too). ``wide_steps`` and ``keep_graphs``:
    on wherever graphs replay when None; the tests force them on, so the CPU checks their
    arithmetic too. ``on_schedule(group, schedule)``: called before each group trains
    (benchmarks/graph_schedule.py counts what a CUDA run would replay).
    """

    name = "vectorized"

    def __init__(self, device: str | torch.device | None = None, fallback_on_error: bool = True,
                 cuda_graphs: bool = True, graph_min_repeats: int | None = None, wide_steps: bool | None = None,
                 keep_graphs: bool | None = None, on_schedule: Callable[[Group, Schedule], None] | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cuda" if available() else "cpu")
        self.fallback_on_error = fallback_on_error
        self.counters = {"vectorized_requests": 0, "fallback_requests": 0, "groups": 0, "vmapped_steps": 0,
                         "graph_steps": 0, "idle_rows": 0}
        self.cuda_graphs = cuda_graphs
        self.graph_min_repeats = GRAPH_MIN_REPEATS if graph_min_repeats is None else graph_min_repeats
        self.wide_steps = wide_steps
        # Why requests ran on the reference path (on the engine's device all the same): reason -> count.
        self.fallback_reasons: dict[str, int] = {}
        self.fallback_errors: dict[str, str] = {}     # "vmap error (TYPE)" -> the first such error's first line
        # Why recurring steps ran eagerly on CUDA instead of replaying a graph: reason -> failed captures.
        self.eager_reasons: dict[str, int] = {}
        # id(host tensor) -> (that tensor, pinned so that its id stays its own; its device copy)
        self._device_copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warned: set = set()     # failed group keys and fallback reasons already named in a warning
        self.keep_graphs = keep_graphs
        self._kept = KeptGroups()
        self.on_schedule = on_schedule

    def info(self) -> dict:
        return {**super().info(), "device": str(self.device), "keep_graphs": self._keep_on(), **self.counters,
                "fallback_reasons": dict(self.fallback_reasons), "fallback_errors": dict(self.fallback_errors),
                "eager_reasons": dict(self.eager_reasons)}

    def training_layout(self, channels_last: bool) -> tuple[str, int]:
        """Its vmapped groups train in the default layout whatever ``run.memory_format: auto``
        means; its requests on the reference path (counted in this process) in the layout the
        reference engine takes. So: the layout most requests trained in, and how many trained in
        the other one."""
        # (a method's own loop, Per-FedAvg's, leaves run.memory_format out on every engine)
        trained_apart = sum(n for reason, n in self.fallback_reasons.items() if reason not in (ZERO_STEPS, OWN_LOOP))
        if not channels_last or not trained_apart:
            return "contiguous", 0
        if not self.counters.get("vectorized_requests"):
            return "channels_last", 0
        return "contiguous", trained_apart

    def close(self) -> None:
        """Free the device copies of the data and the kept groups (the runner calls this at the end of a run)."""
        self._device_copies.clear()
        self._kept.clear()

    # --- phases -------------------------------------------------------------------------
    def deliver(self, rnd: int, jobs: list[Job]) -> dict[int, JobResult]:
        host = self.host
        tasks: dict[int, ClientTask] = {}
        for job in jobs:
            def fn(task, job=job):
                return host.run(rnd, job, VecClient(host, job.cid, rnd, replace(job.tally), task, self._own_loop))

            tasks[job.cid] = ClientTask(fn)
        order = list(tasks.values())
        try:
            for task in order:
                task.resume()
                if task.error is not None:
                    raise task.error
            while True:
                waiting = [t for t in order if not t.done]
                if not waiting:
                    break
                requests = [t.request for t in waiting]
                assert all(r is not None for r in requests)     # a task not done is blocked in train()
                self._serve(requests)  # type: ignore[arg-type]
                for task in waiting:
                    task.resume()
                    if task.error is not None:
                        raise task.error
        finally:
            for task in order:   # on failure, end the clients still blocked in train()
                task.abandon()
        return {cid: task.output for cid, task in tasks.items()}

    # --- serving train requests ---------------------------------------------------------
    def _serve(self, requests: list[TrainRequest]) -> None:
        groups: dict[tuple, list[TrainRequest]] = {}
        for req in requests:
            key = group_key(req)
            if isinstance(key, str):
                self._name_reason_once(key)
                self._train_reference(req, key)
            else:
                groups.setdefault(key, []).append(req)
        with strict_fp32(self.device):     # outside the fallback's try: a failure here is not a vmap failure
            self._train_groups(groups)

    def _train_groups(self, groups: dict[tuple, list[TrainRequest]]) -> None:
        for key, reqs in groups.items():
            try:
                self._train_group(reqs)
                self.counters["vectorized_requests"] += len(reqs)
                self.counters["groups"] += 1
            except Exception as e:  # a term that cannot be vmapped after all: reference path
                self._kept.forget(reqs)
                if not self.fallback_on_error:
                    raise
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(f"vectorized engine: training failed ({type(e).__name__}: {e}); these clients "
                                  "train on the reference path, one client at a time; each is counted in "
                                  "summary.json (engine.fallback_reasons)", RuntimeWarning, stacklevel=2)
                # the error's type in the reason (an out-of-memory, an engine bug and a term that does not
                # vmap count apart in summary.json) and the first one's message beside it
                reason = f"vmap error ({type(e).__name__})"
                self.fallback_errors.setdefault(reason, (str(e).splitlines() or [""])[0][:200])
                for req in reqs:
                    req.result = req.error = None
                    self._train_reference(req, reason)

    def _train_reference(self, req: TrainRequest, reason: str) -> None:
        try:      # the in-process client's own training (VecClient.fit is what posted the request)
            req.result = SimClient.fit(req.client, req.weights, req.terms, req.settings, data=req.data,
                                       stream=req.stream, start_epoch=req.start_epoch, trainable=req.trainable,
                                       optimizer_state=req.optimizer_state, augment=req.augment,
                                       statistics=req.statistics)
        except Exception as e:  # noqa: BLE001 - re-raised in the client's own thread, as the reference would
            req.error = e
        self._count_fallback(reason)

    def _own_loop(self, result) -> None:
        """A client trained in its method's own loop instead of ``client.train``: the engine never
        saw it, so it ran one client at a time; counted like a request on the reference path."""
        self._name_reason_once(OWN_LOOP)
        self._count_fallback(OWN_LOOP)

    def _count_fallback(self, reason: str) -> None:
        self.counters["fallback_requests"] += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def _name_reason_once(self, reason: str) -> None:
        """Name a reason a request cannot be vmapped in a warning when it first occurs, not only in
        summary.json (a call with no step costs nothing)."""
        if reason == ZERO_STEPS or reason in self._warned:
            return
        self._warned.add(reason)
        if reason == OWN_LOOP:
            warnings.warn(f"vectorized engine: {self.host.algorithm.name} trains in its own loop, not "
                          "client.train, so its clients train one at a time; each such training is counted in "
                          f"summary.json (engine.fallback_reasons: {OWN_LOOP!r})", RuntimeWarning, stacklevel=2)
            return
        why = {"augmentation": "an augment callable that is not an Augmentation"}.get(reason, reason)
        warnings.warn(f"vectorized engine: training calls with {why} run on the reference path, one client at "
                      "a time; each is counted in summary.json (engine.fallback_reasons)", RuntimeWarning,
                      stacklevel=2)

    # --- the vectorized training loop ---------------------------------------------------
    def _pool(self, data) -> Pool:
        """A data view's images, labels and normalisation on the device. Each tensor is copied once
        per engine and kept until ``close``, since kept CUDA graphs read the copies' addresses; a
        view that pairs the same images with other labels shares the images' copy. (A view whose
        tensors a method makes anew for every call would be copied, and kept, anew each time.)"""
        return (self._on_device(data.x), self._on_device(data.y), self._on_device(data.mean),
                self._on_device(data.std))

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        kept = self._device_copies.get(id(tensor))
        if kept is None:
            kept = self._device_copies[id(tensor)] = (tensor, tensor.to(self.device))
        return kept[1]

    def _graphs_on(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda"

    def _wide_on(self) -> bool:
        return self._graphs_on() if self.wide_steps is None else self.wide_steps

    def _keep_on(self) -> bool:
        return self._graphs_on() if self.keep_graphs is None else self.keep_graphs

    def _train_group(self, reqs: list[TrainRequest]) -> None:
        fresh = build_group(reqs, self.device)
        g = self._kept.group_for(fresh) if self._keep_on() else fresh
        C = len(reqs)
        s = reqs[0].settings

        def batches(req: TrainRequest) -> Iterator[ClientBatch]:
            """(positions, the augmentation's draws and dropout masks, or None) per batch, drawn in
            train_local's order."""
            n = len(req.data.train_idx)
            aug = req.augment
            assert aug is None or isinstance(aug, Augmentation)      # group_key let no other into a group
            sample_shape = tuple(req.data.x.shape[1:])
            for e in range(s.epochs):
                gen = req.client.generator(req.stream, req.start_epoch + e)
                for positions in epoch_batches(n, s.batch_size, s.drop_last, gen):
                    draws = aug.draw(len(positions), gen) if aug is not None else {}
                    rows = aug.rows(len(positions)) if aug is not None else len(positions)
                    draws.update(draw_masks(g.model, sample_shape, rows, gen))
                    yield positions, (draws or None)

        schedule = plan([batches(r) for r in reqs], [r.data.train_idx.cpu() for r in reqs],
                        self._wide_on(), self.graph_min_repeats)
        if self.on_schedule is not None:
            self.on_schedule(g, schedule)
        dev = self.device
        all_pos = schedule.positions.to(dev)
        all_pool = schedule.pool_rows.to(dev)
        all_members = schedule.partial_members.to(dev)
        all_active = schedule.active.to(dev) if schedule.active is not None else None
        all_draws = {name: t.to(dev) for name, t in schedule.draws.items()}
        g.model.train()
        pool = self._pool(reqs[0].data)

        def step(idx, pool_idx, pos, active=None, draws=None):
            return vmapped_step(g, pool, dev, idx, pool_idx, pos, active, draws)

        row = member_row = wide_row = 0
        book = g.graphs
        book.kind_counts.update(narrow_kinds(schedule.steps))
        adam = adam_table(g, schedule.iterations, dev)
        for st, meta in zip(schedule.steps, schedule.draw_rows):
            m = len(st.members)
            width = st.width
            draws = None if meta is None else {
                name: all_draws[name][off:off + width * math.prod(shape)].view(width, *shape)
                for name, (off, shape) in meta.items()}
            idx = active = None
            if st.wide:
                assert all_active is not None
                active = all_active[wide_row]
                wide_row += 1
                self.counters["idle_rows"] += C - m
            elif m < C:
                idx = all_members[member_row:member_row + m]
                member_row += m
            rows = slice(row, row + width * st.size)
            row += width * st.size
            pool_idx, pos = all_pool[rows].view(width, st.size), all_pos[rows].view(width, st.size)
            # A narrow step's graph serves every step with as many members at its batch size: the
            # members' rows (idx) are one of its inputs.
            kind = step_kind(m, st.size, st.wide)
            action = book.action(kind, self._graphs_on() and graphable(kind, book, self.graph_min_repeats))
            if action == CAPTURE:
                book.graphs[kind] = self._capture(step, book, width, st.size, idx, st.wide, draws)
                action = book.action(kind, True)
            if adam is not None:
                assert g.adam_now is not None
                g.adam_now.copy_(adam[st.iteration])    # this step's bias corrections (every member's step it + 1)
            if action == REPLAY:
                losses, parts = book.graphs[kind].replay(pool_idx, pos, active, draws, idx)
                self.counters["graph_steps"] += 1
            else:
                losses, parts = step(idx, pool_idx, pos, active, draws)
                book.eager_once.add(kind)
            g.records.append((st.row_clients, st.size, losses, parts))
            self.counters["vmapped_steps"] += 1
        unstack(g, dev)

    def _capture(self, step, book, width: int, size: int, idx: torch.Tensor | None,
                 wide: bool = False, draws: dict[str, torch.Tensor] | None = None) -> GraphedStep:
        """A CUDA graph of one recurring step of the group, or one marked failed (counted by
        reason: those steps then run eagerly, which is slower but the same arithmetic)."""
        graphed = GraphedStep(step, book, self.device, width, size, idx, wide, draws)
        if not graphed.ok:
            reason = f"cuda graph capture failed ({graphed.error})"
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
            if reason not in self._warned:
                self._warned.add(reason)
                warnings.warn(f"vectorized engine: {reason}; those steps run eagerly (slower, the same arithmetic), "
                              "each failed capture counted in summary.json (engine.eager_reasons)", RuntimeWarning,
                              stacklevel=2)
        return graphed
