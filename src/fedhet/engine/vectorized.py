"""The vectorized engine: many clients' local training as one ``torch.func.vmap`` computation.

The algorithm contract stays untouched: every client of a phase runs its ordinary
``client_update`` in its own thread, and ``client.train(...)`` does not train but posts a
request and blocks. Only one thread runs at a time (a baton passed by the engine), so client code
never runs concurrently and results do not depend on thread timing. When every client of the
phase is blocked in ``train`` or finished, the engine groups the pending requests by
(architecture, settings, trainable set, carried optimizer state, loss-term signature, weight
shapes), stacks each group's weights along a new client dimension and trains the group in one
loop:

* each step runs ``vmap`` over the clients of ``functional_call`` + the clients' loss terms (the
  per-client term objects are rebuilt inside the vmapped function from their stacked tensor
  constants), then ordinary autograd on the *sum* of the per-client losses, which gives every
  client exactly the gradient of its own loss (the clients share no tensor);
* the optimizer is local training's SGD kernel (:mod:`fedhet.training.optim`, the rule of
  ``torch.optim.SGD``) applied to the stacked tensors: weight decay, momentum with dampening /
  Nesterov (a client's first step starts its buffer from the gradient, like torch) and
  per-client ``clip_grad_norm``; or its Adam rule (``torch.optim.Adam``: L2 weight decay,
  amsgrad) from a fresh state, every client of a step taking the step number the schedule gives
  it (each client with steps left takes exactly one per iteration), with the bias corrections
  computed in double on the host for the whole loop and read from the device;
* the terms' statistics (``LossTerm.statistics``, FedCME's per-class feature sums) are computed
  under the same ``vmap`` and added up per client in its step order, starting from the request's
  ``statistics``, like ``train_local``;
* unequal local step counts and batch sizes use buckets, not padding: each client walks its own
  batch sequence (the exact batches the reference draws), and at every iteration the clients are
  bucketed by the size of their next batch; each bucket is one vmapped step over the stacked
  slices of its members. Padding would change what opaque loss terms and BatchNorm compute (the
  mean over a padded batch, batch statistics), buckets keep every client's arithmetic that of
  the reference. A client whose steps are done takes no step; clients of equal size and the
  full batches of unequal ones move in lockstep, only the remainder batches (``n % B``) of each
  epoch may run as small extra buckets;
* BatchNorm runs in training mode with per-client stacked running statistics, which the vmapped
  forward updates in place with the reference's rule (checked against it in the tests).

Exactness: batch order, initial state, optimizer rule and loss are the reference's, but vmapped
convolutions run as grouped convolutions and batched matmuls, whose float summation order
differs, so results equal the reference to float tolerance, not bitwise. Measured after two
rounds (tests/engine/test_engine_vectorized.py): ~1e-7 for a smooth model; with ReLU/max-pool models a
pre-activation within rounding of a kink occasionally takes the other side, moving a few
elements by up to lr * |dL/dh| / batch (~1e-5). In a chaotic regime (large lr with momentum 0.9)
any two float-different runs drift apart, this engine and the reference included. On CUDA the
loop runs with TF32 off (torch's default lets cuDNN convolutions use it, a 10-bit mantissa):
``precision: fp32`` means fp32 on every device (for cnn2 on an H200, bf16 measured slower than
fp32: docs/performance.md).

What falls back to the reference path (``train_local``, exact, on the client host's device):
requests with a loss term that does not declare itself pure (``LossTerm.vectorizable``), Adam
requests that carry an optimizer state from an earlier call (their clients' step counts differ),
requests whose ``augment`` is an opaque callable rather than a
:class:`fedhet.training.augment.Augmentation`, requests with zero steps, and - when
``fallback_on_error`` is true - a group whose vmapped step raises (a term that turns out not to be
vmappable). ``Vectorized.counters`` counts them, and ``fallback_reasons`` (in the run's summary)
says why, per reason.

Augmentation (FedACD's mixup, FedClassAvg's two views): an ``Augmentation`` splits into ``draw``
(every random draw of a batch, on the host) and ``apply`` (tensor arithmetic). The schedule takes
each batch's draws from the client's stream right after its positions, as ``train_local`` does,
sends them to the device with the schedule, and each step applies them per client under ``vmap``
before the forward pass. Requests whose augmentations share a ``signature`` train in one group.

CUDA graphs (``cuda_graphs``, ``run.cuda_graphs``; CUDA only): a group's whole schedule - which
clients step together, their batches' pool indices and positions - is computed before training and
copied to the device in one transfer, so no step waits on the host. Steps that recur replay one
captured graph (forward, per-client losses, gradients, SGD or Adam update, statistics): the first
of a kind runs eagerly, the second is captured, the rest replay it with their inputs copied in. The
arithmetic is the eager step's. Which steps are "of a kind":

* wide steps (``wide_steps``; on wherever graphs are): every step of at least half the group at a
  batch size that such steps use at least ``GRAPH_MIN_REPEATS`` times runs at the group's full
  width, with a per-client ``active`` mask; the clients outside the step compute on a stand-in
  batch and keep their weights, optimizer state, BatchNorm statistics and term statistics. So the
  steps that one client's remainder batch splits off from the others, and those after a client has
  finished, replay the one full-width graph instead of running eagerly as new (members, size)
  pairs. The stand-in rows are wasted work, counted as ``idle_rows``;
* the other ("narrow") steps per (number of members, size), when that recurs ``GRAPH_MIN_REPEATS``
  times: the members' rows are an input of the graph, so the steps left once the small clients have
  finished replay one graph per count of clients left, whichever clients they are.

A group's graphs share one memory pool. With ``keep_graphs`` (``run.keep_graphs``) a later group
of the same signature (the same architecture, settings, terms, number of clients...) trains in the
same stacked buffers, its values copied in, and keeps the earlier groups' graphs and counts: in a
long run the steps of every kind, the one-client remainder batches (n mod B) included, replay
graphs captured once instead of once per group. Its costs: each group is still built before its
values are copied in (twice a group's memory at that moment), and groups that differ in their
number of clients (partial participation, groups per architecture) keep separate buffers, up to
``KEPT_GROUPS``. The equivalence tests replay graphs
(``graph_min_repeats=2``), run the wide steps on the CPU as well (``wide_steps=True``), and run
without graphs under ``FEDHET_TEST_CUDA_GRAPHS=0``. A failed capture leaves that kind's steps
eager, counted in ``eager_reasons``. Measured on an H200 (FedCME setting, before wide steps): 2.6x
the eager steps, 0.71x of the device's one-batch ceiling (docs/performance.md).

Device: the engine trains on ``device``; the client host (``run.device``, normally the same
device) runs the clients' own code there too - messages and client state arrive on it and the
trained weights stay on it until the host hands the reply back to the CPU (engine/host.py). With a
CPU host and a CUDA engine (tests, benchmarks) the data pool is copied to the device once and the
results come back to the CPU.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from fedhet.core.contract import (
    Arrays,
    Batch,
    Forward,
    LocalResult,
    TrainSettings,
    normalize_uint8,
)
from fedhet.core.errors import NumericalError
from fedhet.engine.host import ClientHost, Job, JobResult, SimClient, Tally
from fedhet.engine.loop import Transport
from fedhet.training.augment import Augmentation
from fedhet.training.local import check_finite, epoch_batches, forward, train_local
from fedhet.training.objective import LossTerm, accumulate_statistics
from fedhet.training.optim import SGD, Adam, clip_coefficient, make_optimizer
from fedhet.training.precision import strict_fp32, tf32_allowed  # noqa: F401 - tf32_allowed: benchmarks


def available() -> bool:
    """True where the vectorized engine is the better choice: a CUDA device is present."""
    return torch.cuda.is_available()


def _term_layout(term: LossTerm):
    """``(static signature, tensor leaves)`` of a term, or None if it cannot be stacked.

    Tensor leaves are ``((attr, key), tensor)`` for tensor attributes (key None) and for the
    values of dict-of-tensor attributes; everything else must be a plain value or a module and
    becomes part of the signature, so grouped clients' terms differ only in tensor values.
    """
    if not term.vectorizable:
        return None
    static, leaves = [], []
    for attr, value in sorted(vars(term).items()):
        if isinstance(value, torch.Tensor):
            leaves.append(((attr, None), value))
        elif isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            static.append((attr, "dict", tuple(value)))
            leaves.extend(((attr, k), v) for k, v in value.items())
        elif value is None or isinstance(value, (bool, int, float, str)):
            static.append((attr, value))
        elif isinstance(value, nn.Module):
            static.append((attr, "module", id(value)))
        else:
            return None
    shapes = tuple((path, tuple(t.shape), t.dtype) for path, t in leaves)
    return (type(term), tuple(static), shapes), leaves


@dataclass
class _Request:
    client: VecClient
    weights: Arrays
    terms: list[LossTerm]
    settings: TrainSettings
    start_epoch: int
    trainable: Callable[[str], bool] | None
    optimizer_state: Arrays | None
    augment: Callable | None
    statistics: dict[str, torch.Tensor] | None = None
    result: LocalResult | None = None
    error: BaseException | None = None


class _Abort(Exception):
    """Raised inside a blocked client thread when its phase is abandoned (another client failed,
    or the run was interrupted)."""


class _Task:
    """One client's ``client_update`` in its own thread, run only while the engine waits.

    ``resume`` hands the baton to the client and returns when it blocks in ``train`` (then
    ``request`` is set) or finishes (``done``).
    """

    def __init__(self, fn: Callable[[_Task], JobResult]):
        self._fn = fn
        self._go: queue.SimpleQueue = queue.SimpleQueue()
        self._back: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self.started = False
        self.request: _Request | None = None
        self.done = False
        self.output = None
        self.error: BaseException | None = None
        # Batons asked for (written by the client thread alone, before each wait) and given (by the
        # engine, after each hand-over): the client waits for one not yet given exactly when
        # ``_asked > _given``, a test that cannot go stale while the client takes its baton.
        # ``_abort``: set by the engine before it hands the baton to a client that never ran.
        self._asked = 0
        self._given = 0
        self._abort = False

    def _main(self):
        self._take_baton()
        try:
            if self._abort:
                raise _Abort("phase abandoned before this client ran")
            self.output = self._fn(self)
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread, which re-raises it
            self.error = e
        self.done = True
        self._back.put(None)

    def _take_baton(self) -> None:
        self._asked += 1
        self._go.get()

    def _hand_baton(self) -> None:
        self._go.put(None)
        self._given += 1

    def resume(self) -> None:
        if not self.started:
            self.started = True
            self._thread.start()
        self._hand_baton()
        self._back.get()

    def wait(self, request: _Request) -> LocalResult:
        """Client side: post ``request``, give the baton back, return its result when resumed."""
        self.request = request
        self._back.put(None)
        self._take_baton()
        self.request = None
        if request.error is not None:
            raise request.error
        return request.result

    def abandon(self) -> None:
        """Engine side, after a client's failure or an interrupt (Ctrl-C, SIGTERM) of the engine:
        end a started client. A client blocked in ``train`` gets an error there; one that still
        runs (the interrupt came while it held the baton) is waited for until it blocks or ends;
        one that never got the baton ends without running. Polls, so a second Ctrl-C still stops it."""
        if self._thread.ident is None:
            return
        while not self.done:
            if self._asked > self._given and self._back.empty():
                if self.request is not None:
                    self.request.error = _Abort("phase abandoned: another client failed or the run was interrupted")
                else:
                    self._abort = True
                self._hand_baton()
            try:
                self._back.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()


class VecClient(SimClient):
    """A :class:`SimClient` whose ``train`` is served by the engine, possibly vectorized."""

    def __init__(self, host: ClientHost, cid: int, rnd: int, tally: Tally, task: _Task):
        super().__init__(host, cid, rnd, tally)
        self._task = task

    def fit(self, weights: Arrays, terms: list[LossTerm], settings: TrainSettings, *, start_epoch: int,
            trainable: Callable[[str], bool] | None, optimizer_state: Arrays | None, augment: Callable | None,
            statistics: dict[str, torch.Tensor] | None) -> LocalResult:
        return self._task.wait(_Request(self, weights, terms, settings, start_epoch, trainable, optimizer_state,
                                        augment, statistics))


@dataclass
class _Group:
    """Stacked state of one group of requests trained together."""

    requests: list[_Request]
    model: nn.Module
    names: list[str]                      # every weight name, in the first request's order
    leaves: list[str]                     # trainable parameters, in that order
    weights: dict[str, torch.Tensor]      # name -> (C, ...) on the device
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    has_momentum: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> (C,) bool
    templates: list[LossTerm] = field(default_factory=list)
    batched_paths: list[tuple[int, tuple]] = field(default_factory=list)  # (term index, (attr, key))
    batched_consts: list[torch.Tensor] = field(default_factory=list)      # (C, ...) each
    shared_consts: dict[tuple[int, tuple], torch.Tensor] = field(default_factory=dict)
    records: list = field(default_factory=list)     # (client of each row or None, batch size, losses, parts) per step
    optimizer: SGD | Adam | None = None             # the update kernel (fedhet.training.optim)
    # Adam (fresh state each call): per-client moments, the leaves that have had a gradient, and
    # this step's (lr / bias correction 1, sqrt(bias correction 2)) - a device tensor that the
    # loop fills before each step, so a replayed CUDA graph reads the current step's values.
    adam_m: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_v: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_vmax: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_seen: set[str] = field(default_factory=set)
    adam_now: torch.Tensor | None = None
    # Per client running totals of the terms' statistics ("<term>.<key>" -> (C, ...)), added in
    # each client's step order like train_local, and which clients have a value for each key.
    stat_totals: dict[str, torch.Tensor] = field(default_factory=dict)
    stat_seen: dict[str, torch.Tensor] = field(default_factory=dict)
    # The group's augmentation (one signature: _group_key) with its constants on the device, moved
    # here once: a copy from the host inside a step would break its CUDA graph capture.
    augment: Augmentation | None = None
    # The memory pool of the group's first CUDA graph, which its later graphs share (below).
    graph_pool: tuple | None = None
    # The model's buffers among ``names`` (what a forward pass may change: BatchNorm statistics).
    buffers: list[str] = field(default_factory=list)
    # The group's CUDA graphs by step kind, the kinds that have run eagerly, and how often each
    # narrow kind has occurred: this group's own, or with ``keep_graphs`` those of every group
    # that trained in these buffers before it (``Vectorized._group_for``).
    graphs: dict[tuple, _GraphedStep] = field(default_factory=dict)
    eager_once: set[tuple] = field(default_factory=set)
    kind_counts: Counter = field(default_factory=Counter)


# A (number of members, batch size) step captured as a CUDA graph only if the group's schedule has it
# this often: its first step runs eagerly, the capture costs about one more plus the graph's
# instantiation, and each replay saves most of an eager step (a few ms of Python and launches). At
# FedCME's Table II setting, 4 instead of 16 leaves 58 eager steps of 352 a round instead of 103,
# for 9 captures a round instead of 2.5 (counted on the CPU: benchmarks/graph_schedule.py).
GRAPH_MIN_REPEATS = 4

# keep_graphs: how many group signatures keep their buffers and graphs (FedCME uses two: phase A
# starts its statistics from zero, phase B from phase A's).
KEPT_GROUPS = 8


def _rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) per-client mask shaped to broadcast over ``like``'s (C, ...) rows."""
    return mask.view(-1, *[1] * (like.dim() - 1))


def _only(active: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows of the clients outside a wide step set to zero (an update or a sum they skip)."""
    return torch.where(_rows(active, t), t, 0)


def _keep(active: torch.Tensor, dst: torch.Tensor, new: torch.Tensor) -> None:
    """``dst`` takes ``new`` in the rows of the step's clients and keeps its own elsewhere."""
    dst.copy_(torch.where(_rows(active, new), new, dst))


class _GraphedStep:
    """One recurring step of a group (as many members, the same batch size) captured as a CUDA graph.

    Everything the step reads or writes lives at a fixed address for the group's life: the
    stacked weights, momentum buffers and statistics' totals (updated in place), the loss terms'
    constants, the device data pool, and input buffers that :meth:`replay` fills before each
    launch: the batch's pool indices and positions, for a narrow step its members' rows (``idx``),
    for a full-width step (``wide``) also which of the group's clients
    the step is for, and with an augmentation the step's draws. The losses and parts it returns are
    copies of the graph's outputs.
    ``ok`` is False, with ``error`` set, when capturing failed."""

    def __init__(self, engine: Vectorized, g: _Group, width: int, size: int, idx: torch.Tensor | None,
                 wide: bool = False, draws: dict[str, torch.Tensor] | None = None):
        dev = engine.device
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
            with torch.cuda.stream(side), torch.cuda.graph(self.graph, stream=side, pool=g.graph_pool):
                self.losses, self.parts = engine._step(g, self.idx, self.pool_idx, self.pos, self.active, self.draws)
            if g.graph_pool is None:
                g.graph_pool = self.graph.pool()
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


class Vectorized(Transport):
    """A transport that trains the clients of a phase together with ``vmap``.

    ``device``: default CUDA when available, else CPU. ``fallback_on_error=False`` makes a failing
    vmapped group raise instead of retrying on the reference path (the tests use it, so a
    vectorization bug cannot hide).
    """

    name = "vectorized"

    def __init__(self, device: str | torch.device | None = None, fallback_on_error: bool = True,
                 cuda_graphs: bool = True, graph_min_repeats: int | None = None, wide_steps: bool | None = None,
                 keep_graphs: bool | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cuda" if available() else "cpu")
        self.fallback_on_error = fallback_on_error
        self.counters = {"vectorized_requests": 0, "fallback_requests": 0, "groups": 0, "vmapped_steps": 0,
                         "graph_steps": 0, "idle_rows": 0}
        self.cuda_graphs = cuda_graphs
        # Tests lower it so that their short schedules capture graphs too.
        self.graph_min_repeats = GRAPH_MIN_REPEATS if graph_min_repeats is None else graph_min_repeats
        # Full-width steps with an active mask (see _train_group): where graphs replay, by default;
        # the tests turn them on without graphs, so the CPU checks their arithmetic too.
        self.wide_steps = wide_steps
        # Why requests ran on the reference path (on the engine's device all the same): reason -> count.
        self.fallback_reasons: dict[str, int] = {}
        # Why recurring steps ran eagerly on CUDA instead of replaying a graph: reason -> failed captures.
        self.eager_reasons: dict[str, int] = {}
        self._pool_cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._warned: set = set()
        # keep_graphs: groups of one signature train in the same stacked buffers and keep one set of
        # CUDA graphs (module docstring), at most KEPT_GROUPS signatures, the least recent dropped.
        # None: wherever graphs replay (elsewhere the copies would buy nothing); the tests force it
        # on, so the CPU checks the copies' arithmetic too.
        self.keep_graphs = keep_graphs
        self._kept: OrderedDict[tuple, _Group] = OrderedDict()

    def info(self) -> dict:
        return {**super().info(), "device": str(self.device), "keep_graphs": self._keep_on(), **self.counters,
                "fallback_reasons": dict(self.fallback_reasons), "eager_reasons": dict(self.eager_reasons)}

    def close(self) -> None:
        """Free the device copy of the data pool and the kept groups (the runner calls this at the end of a run)."""
        self._pool_cache.clear()
        self._kept.clear()

    # --- phases -------------------------------------------------------------------------
    def deliver(self, rnd: int, jobs: list[Job]) -> dict[int, JobResult]:
        host = self.host
        tasks: dict[int, _Task] = {}
        for job in jobs:
            def fn(task, job=job):
                return host.run(rnd, job, VecClient(host, job.cid, rnd, replace(job.tally), task))

            tasks[job.cid] = _Task(fn)
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
                self._serve([t.request for t in waiting])
                for task in waiting:
                    task.resume()
                    if task.error is not None:
                        raise task.error
        finally:
            for task in order:   # on failure, end the clients still blocked in train()
                task.abandon()
        return {cid: task.output for cid, task in tasks.items()}

    # --- serving train requests ---------------------------------------------------------
    def _serve(self, requests: list[_Request]) -> None:
        groups: dict[tuple, list[_Request]] = {}
        for req in requests:
            key = self._group_key(req)
            if isinstance(key, str):
                self._train_reference(req, key)
            else:
                groups.setdefault(key, []).append(req)
        with strict_fp32(self.device):     # outside the fallback's try: a failure here is not a vmap failure
            self._train_groups(groups)

    def _train_groups(self, groups: dict[tuple, list[_Request]]) -> None:
        for key, reqs in groups.items():
            try:
                self._train_group(reqs)
                self.counters["vectorized_requests"] += len(reqs)
                self.counters["groups"] += 1
            except Exception as e:  # a term that cannot be vmapped after all: reference path
                # kept buffers and graphs a failed group may have left half-written are not reused
                for sig in [k for k, kept in self._kept.items() if any(r is q for q in kept.requests for r in reqs)]:
                    del self._kept[sig]
                if not self.fallback_on_error:
                    raise
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(f"vectorized training failed ({type(e).__name__}: {e}); "
                                  f"these clients train on the reference path", RuntimeWarning, stacklevel=2)
                for req in reqs:
                    req.result = req.error = None
                    self._train_reference(req, "vmap error")

    def _train_reference(self, req: _Request, reason: str) -> None:
        c = req.client
        try:
            req.result = train_local(
                c.model, req.weights, c.data, req.terms, req.settings, lambda e: c.generator("batches", e),
                start_epoch=req.start_epoch, trainable=req.trainable, optimizer_state=req.optimizer_state,
                augment=req.augment, statistics=req.statistics, where=c.where())
        except Exception as e:  # noqa: BLE001 - re-raised in the client's own thread, as the reference would
            req.error = e
        self.counters["fallback_requests"] += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    @staticmethod
    def _num_steps(req: _Request) -> int:
        n, b = len(req.client.data.train_idx), req.settings.batch_size
        per_epoch = n // b if req.settings.drop_last else -(-n // b)
        return req.settings.epochs * per_epoch

    def _group_key(self, req: _Request) -> tuple | str:
        """The group ``req`` trains in, or why it cannot be vmapped (the reason it is counted under)."""
        if req.augment is not None and not isinstance(req.augment, Augmentation):
            return "augmentation"
        if self._num_steps(req) == 0:
            return "zero steps"
        if req.settings.optimizer not in ("sgd", "adam"):
            return f"optimizer {req.settings.optimizer}"
        if req.settings.optimizer == "adam" and req.optimizer_state:
            return "optimizer adam with carried state"
        layouts = [_term_layout(t) for t in req.terms]
        impure = [t.name for t, lay in zip(req.terms, layouts) if lay is None]
        if impure:
            return f"loss term {impure[0]}"
        c = req.client
        params = {n for n, _ in c.model.named_parameters()}
        trainable = req.trainable or (lambda name: True)
        leaves = tuple(n for n in req.weights if n in params and trainable(n))
        carried = ()
        if req.optimizer_state and req.settings.momentum > 0:
            carried = tuple(n for n in leaves if n in req.optimizer_state)
        shapes = tuple((n, tuple(t.shape), t.dtype) for n, t in req.weights.items())
        data = c.data
        augmentation = req.augment.signature() if req.augment is not None else None
        return (c.arch, req.settings, leaves, carried, shapes, tuple(lay[0] for lay in layouts),
                id(data.x), id(data.y), id(data.mean), id(data.std), augmentation)

    # --- the vectorized training loop ---------------------------------------------------
    def _pool(self, data) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The shared data pool on the device (copied once per engine)."""
        key = id(data.x)
        if key not in self._pool_cache:
            dev = self.device
            self._pool_cache[key] = (data.x.to(dev), data.y.to(dev), data.mean.to(dev), data.std.to(dev))
        return self._pool_cache[key]

    def _stack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([t.detach() for t in tensors]).to(self.device)

    def _build_group(self, reqs: list[_Request]) -> _Group:
        first = reqs[0]
        model = first.client.model
        params = {n for n, _ in model.named_parameters()}
        trainable = first.trainable or (lambda name: True)
        names = list(first.weights)
        leaves = [n for n in names if n in params and trainable(n)]
        g = _Group(reqs, model, names, leaves,
                   {n: self._stack([r.weights[n] for r in reqs]) for n in names})
        buffers = {n for n, _ in model.named_buffers()}
        g.buffers = [n for n in names if n in buffers]
        s = first.settings
        g.optimizer = make_optimizer(s)
        g.augment = first.augment.to(self.device) if isinstance(first.augment, Augmentation) else None
        # Statistics totals start from each request's own (phase B continues phase A's).
        keys = list(dict.fromkeys(k for r in reqs for k in (r.statistics or {})))
        for key in keys:
            proto = next(r.statistics[key] for r in reqs if r.statistics and key in r.statistics)
            g.stat_totals[key] = self._stack([(r.statistics or {}).get(key, torch.zeros_like(proto)) for r in reqs])
            g.stat_seen[key] = torch.tensor([bool(r.statistics) and key in r.statistics for r in reqs],
                                            device=self.device)
        if isinstance(g.optimizer, Adam):
            for n in leaves:
                g.adam_m[n] = torch.zeros_like(g.weights[n])
                g.adam_v[n] = torch.zeros_like(g.weights[n])
                if g.optimizer.amsgrad:
                    g.adam_vmax[n] = torch.zeros_like(g.weights[n])
            g.adam_now = torch.zeros(2, dtype=torch.float32, device=self.device)
        elif s.momentum > 0:
            for n in leaves:
                carried = first.optimizer_state is not None and n in first.optimizer_state
                g.momentum[n] = (self._stack([r.optimizer_state[n] for r in reqs]) if carried
                                 else torch.zeros_like(g.weights[n]))
                g.has_momentum[n] = torch.full((len(reqs),), carried, dtype=torch.bool, device=self.device)
        # Loss terms: the first client's objects are templates; their tensor constants are
        # stacked (or shared, when every client holds the very same tensor).
        layouts = [[_term_layout(t)[1] for t in r.terms] for r in reqs]
        g.templates = list(first.terms)
        for j in range(len(first.terms)):
            for li, (path, tensor) in enumerate(layouts[0][j]):
                values = [lay[j][li][1] for lay in layouts]
                if all(v is tensor for v in values):
                    g.shared_consts[(j, path)] = tensor.detach().to(self.device)
                else:
                    g.batched_paths.append((j, path))
                    g.batched_consts.append(self._stack(values))
        return g

    def _group_for(self, reqs: list[_Request]) -> _Group:
        """The group ``reqs`` train in: a new one, or with ``keep_graphs`` the kept group of the same
        signature with ``reqs``' weights, optimizer state, statistics and term constants copied into
        its buffers (in place: its CUDA graphs read those addresses)."""
        fresh = self._build_group(reqs)
        if not self._keep_on():
            return fresh
        signature = (self._group_key(reqs[0]), len(reqs), tuple(fresh.batched_paths), tuple(fresh.shared_consts),
                     tuple(sorted(fresh.momentum)), tuple(sorted(fresh.stat_totals)))
        kept = self._kept.get(signature)
        if kept is None:
            # Shared constants may be the caller's own tensors (to() hands back one already on the
            # device): later groups copy into these buffers, so they must be the group's own.
            fresh.shared_consts = {k: t.clone() for k, t in fresh.shared_consts.items()}
            self._kept[signature] = fresh
            while len(self._kept) > KEPT_GROUPS:
                self._kept.popitem(last=False)
            return fresh
        self._kept.move_to_end(signature)
        with torch.no_grad():
            for mine, theirs in [(kept.weights, fresh.weights), (kept.momentum, fresh.momentum),
                                 (kept.has_momentum, fresh.has_momentum), (kept.adam_m, fresh.adam_m),
                                 (kept.adam_v, fresh.adam_v), (kept.adam_vmax, fresh.adam_vmax),
                                 (kept.shared_consts, fresh.shared_consts)]:
                for name, t in theirs.items():
                    mine[name].copy_(t)
            for mine_t, t in zip(kept.batched_consts, fresh.batched_consts):
                mine_t.copy_(t)
            # statistics: the requests' own (phase B continues phase A's), zero where they have none
            for key, total in kept.stat_totals.items():
                if key in fresh.stat_totals:
                    total.copy_(fresh.stat_totals[key])
                    kept.stat_seen[key].copy_(fresh.stat_seen[key])
                else:
                    total.zero_()
                    kept.stat_seen[key].fill_(False)
        kept.requests, kept.records = reqs, []
        return kept

    def _train_group(self, reqs: list[_Request]) -> None:
        g = self._group_for(reqs)
        C = len(reqs)
        s = reqs[0].settings

        def batches(req: _Request):
            """(positions, the augmentation's draws or None) per batch, drawn in train_local's order."""
            n = len(req.client.data.train_idx)
            aug = req.augment
            for e in range(s.epochs):
                gen = req.client.generator("batches", req.start_epoch + e)
                for positions in epoch_batches(n, s.batch_size, s.drop_last, gen):
                    yield positions, (aug.draw(len(positions), gen) if aug is not None else None)

        # The whole schedule first (it does not depend on what training computes): which clients
        # step together at each iteration, with their batches' pool indices and positions copied to
        # the device in one transfer each, so the loop itself sends nothing from the host.
        streams = [batches(r) for r in reqs]
        upcoming = [next(it, None) for it in streams]
        train_idx = [r.client.data.train_idx.cpu() for r in reqs]     # what the reference indexes
        # (members, size, iteration, their (positions, draws))
        steps: list[tuple[list[int], int, int, list[tuple[torch.Tensor, dict | None]]]] = []
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
        # With CUDA graphs, a step of at least half the group at a batch size that recurs runs at the
        # group's full width ("wide"): the clients outside it compute on a stand-in batch and keep
        # their weights, optimizer state and statistics (the step's ``active`` mask). All such steps
        # then replay one graph, where each new set of members would otherwise be a new (members,
        # size) step, run eagerly unless it recurs: one client's remainder batch (n % B) at the end
        # of its epoch splits the others off into such a set, and so does each client that finishes
        # before the rest. The stand-in rows are computed and thrown away (counted as idle_rows).
        wide_sizes: set[int] = set()
        if self._wide_on():
            wide_count = Counter(size for members, size, _, _ in steps if 2 * len(members) >= C)
            wide_sizes = {b for b, k in wide_count.items() if k >= self.graph_min_repeats}
        # (members, batch size, iteration, wide, the client of each row: None for a stand-in row)
        plan: list[tuple[list[int], int, int, bool, list[int | None]]] = []
        positions: list[torch.Tensor] = []
        pool_rows: list[torch.Tensor] = []
        partial: list[int] = []                # the members of the narrow steps that leave someone out
        masks: list[list[bool]] = []           # per wide step, which rows are its clients
        # The augmentations' draws, per name all in one flat tensor (one transfer each): a step's
        # rows are (offset, per-row shape) into it.
        draw_parts: dict[str, list[torch.Tensor]] = {}
        draw_rows: list[dict[str, tuple[int, tuple]] | None] = []
        offsets: dict[str, int] = {}
        for members, size, it, batch in steps:
            wide = size in wide_sizes and 2 * len(members) >= C
            if wide:
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
                client = i if wide else members[i]
                positions.append(p)
                pool_rows.append(train_idx[client][p])
            meta = None
            if rows_batch[0][1] is not None:
                meta = {}
                for name, first in rows_batch[0][1].items():
                    meta[name] = (offsets.get(name, 0), tuple(first.shape))
                    flat = [d[name].reshape(-1) for _, d in rows_batch]
                    draw_parts.setdefault(name, []).extend(flat)
                    offsets[name] = offsets.get(name, 0) + sum(len(f) for f in flat)
            draw_rows.append(meta)
            plan.append((members, size, it, wide, row_clients))
        dev = self.device
        all_pos = torch.cat(positions).to(dev)
        all_pool = torch.cat(pool_rows).to(dev)
        all_members = torch.tensor(partial, dtype=torch.long).to(dev)
        all_active = torch.tensor(masks, dtype=torch.bool).to(dev) if masks else None
        all_draws = {name: torch.cat(parts).to(dev) for name, parts in draw_parts.items()}
        g.model.train()
        row = member_row = wide_row = 0
        # Steps that recur - as many clients with the same batch size, e.g. all of them with full
        # batches, or the clients left once the smallest have finished - replay one CUDA graph per
        # (number of members, size), and wide steps one per size: its first step runs eagerly (it
        # creates the statistics' totals and warms up cuDNN), the second is captured, the rest replay
        # it with their inputs copied in. A narrow key that recurs fewer than GRAPH_MIN_REPEATS times
        # in the schedule is not worth a capture.
        g.kind_counts.update((len(members), size) for members, size, _, wide, _ in plan if not wide)
        adam = self._adam_table(g, iteration)
        graphs, eager_once = g.graphs, g.eager_once
        for (members, size, it, wide, row_clients), meta in zip(plan, draw_rows):
            m = len(members)
            width = C if wide else m
            draws = None if meta is None else {
                name: all_draws[name][off:off + width * math.prod(shape)].view(width, *shape)
                for name, (off, shape) in meta.items()}
            idx = active = None
            if wide:
                assert all_active is not None
                active = all_active[wide_row]
                wide_row += 1
                self.counters["idle_rows"] += C - m
            elif m < C:
                idx = all_members[member_row:member_row + m]
                member_row += m
            rows = slice(row, row + width * size)
            row += width * size
            pool_idx, pos = all_pool[rows].view(width, size), all_pos[rows].view(width, size)
            # A narrow step's graph serves every step with as many members at its batch size: the
            # members' rows (idx) are one of its inputs.
            key: tuple = ("wide", size) if wide else (m, size)
            graphable = self._graphs_on() and (wide or g.kind_counts[key] >= self.graph_min_repeats)
            if graphable and key not in graphs and key in eager_once:
                graphs[key] = self._capture(g, width, size, idx, wide, draws)
            graph = graphs.get(key) if graphable else None
            if adam is not None:
                g.adam_now.copy_(adam[it])       # this step's bias corrections (every member's step it + 1)
            if graph is not None and graph.ok:
                losses, parts = graph.replay(pool_idx, pos, active, draws, idx)
                self.counters["graph_steps"] += 1
            else:
                losses, parts = self._step(g, idx, pool_idx, pos, active, draws)
                eager_once.add(key)
            g.records.append((row_clients, size, losses, parts))
            self.counters["vmapped_steps"] += 1
        self._finish(g, C)

    def _adam_table(self, g: _Group, iterations: int) -> torch.Tensor | None:
        """Adam's (lr / (1 - beta1^k), sqrt(1 - beta2^k)) for steps k = 1..iterations, computed in
        double like ``torch.optim.Adam``'s Python scalars and sent to the device once (None for SGD)."""
        opt = g.optimizer
        if not isinstance(opt, Adam):
            return None
        rows = [opt.corrections(k) for k in range(1, iterations + 1)]
        return torch.tensor(rows, dtype=torch.float32).to(self.device)

    def _graphs_on(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda"

    def _wide_on(self) -> bool:
        return self._graphs_on() if self.wide_steps is None else self.wide_steps

    def _keep_on(self) -> bool:
        return self._graphs_on() if self.keep_graphs is None else self.keep_graphs

    def _capture(self, g: _Group, width: int, size: int, idx: torch.Tensor | None,
                 wide: bool = False, draws: dict[str, torch.Tensor] | None = None) -> _GraphedStep:
        """A CUDA graph of one recurring step of the group, or one marked failed (counted by
        reason: those steps then run eagerly, which is slower but the same arithmetic)."""
        graphed = _GraphedStep(self, g, width, size, idx, wide, draws)
        if not graphed.ok:
            reason = f"cuda graph capture failed ({graphed.error})"
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        return graphed

    def _step(self, g: _Group, idx: torch.Tensor | None, pool_idx: torch.Tensor, pos: torch.Tensor,
              active: torch.Tensor | None = None,
              draws: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One SGD or Adam step for some clients of the group, all with the same batch size (``idx``:
        their rows on the device, None when all step; ``pool_idx`` / ``pos``: (clients, batch size)
        pool indices and positions of their batches, on the device). ``active``: a full-width step's
        (C,) mask of the clients it is for; the others' rows are computed and discarded, their
        state left as it was. ``draws``: the members' augmentation draws, (members, ...) each, applied
        per client with the group's augmentation before the forward pass, as ``train_local`` applies
        them. Returns the step's per-client losses and loss parts (on the device)."""
        dev = self.device
        s = g.requests[0].settings
        full = idx is None
        # What the forward pass may change in place (BatchNorm's running statistics), for the rows
        # outside a wide step to get back.
        kept = {n: g.weights[n].clone() for n in g.buffers} if active is not None else {}

        def take(t: torch.Tensor) -> torch.Tensor:
            return t if full else t.index_select(0, idx)

        w = {}
        for n in g.names:
            t = take(g.weights[n])
            w[n] = t.detach().requires_grad_(True) if n in g.leaves else t
        consts = [take(t) for t in g.batched_consts]

        x_pool, y_pool, mean, std = self._pool(g.requests[0].client.data)
        x = normalize_uint8(x_pool[pool_idx], mean, std)      # ClientData.inputs, per client
        y = y_pool[pool_idx]

        model, templates, paths, shared = g.model, g.templates, g.batched_paths, g.shared_consts
        augment = g.augment
        use_bf16 = s.precision == "bf16"

        def client_loss(w, x, y, index, consts, draws):
            batch = Batch(x, y, index)
            if augment is not None:
                batch = augment.apply(batch, draws)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                out = forward(model, w, batch.x)
            out = Forward(out.features.float(), out.logits.float())
            values = {}
            for (j, (attr, key)), value in [*zip(paths, consts), *shared.items()]:
                values.setdefault(j, {})
                if key is None:
                    values[j][attr] = value
                else:
                    values[j].setdefault(attr, {})[key] = value
            loss, parts, stats = None, [], {}
            seen = Forward(out.features.detach(), out.logits.detach())
            for j, template in enumerate(templates):
                term = copy.copy(template)
                for attr, value in values.get(j, {}).items():
                    # dict attributes keep the template's key order (terms may iterate them)
                    setattr(term, attr, {k: value[k] for k in getattr(template, attr)} if isinstance(value, dict)
                            else value)
                v = term(out, batch, w)
                parts.append(v.detach().float())
                loss = v if loss is None else loss + v
                accumulate_statistics([term], seen, batch, stats)
            return loss, torch.stack(parts), stats

        losses, parts, stats = torch.func.vmap(client_loss)(w, x, y, pos, consts, draws or {})
        leaves = [w[n] for n in g.leaves]
        grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=True) if leaves else []
        with torch.no_grad():
            if isinstance(g.optimizer, Adam):
                self._adam(g, w, grads, idx, s, active)
            else:
                self._sgd(g, w, grads, idx, s, active)
            if not full:   # the bucket worked on copies: write back weights and BatchNorm statistics
                for n in g.names:
                    g.weights[n].index_copy_(0, idx, w[n].detach())
            for n, before in kept.items():
                g.weights[n].copy_(torch.where(_rows(active, before), g.weights[n], before))
            self._accumulate(g, stats, idx, active)
        return losses.detach(), parts

    def _accumulate(self, g: _Group, stats: dict[str, torch.Tensor], idx, active: torch.Tensor | None = None) -> None:
        """Add one step's statistics (rows: the step's members, or the rows ``active`` marks of a
        full-width step) to the group's per-client totals."""
        C = len(g.requests)
        for key, value in stats.items():
            value = value.detach()
            if key not in g.stat_totals:
                g.stat_totals[key] = value.new_zeros((C, *value.shape[1:]))
                g.stat_seen[key] = torch.zeros(C, dtype=torch.bool, device=value.device)
            if active is not None:
                g.stat_totals[key] += _only(active, value)
                g.stat_seen[key] |= active
            elif idx is None:
                g.stat_totals[key] += value
                g.stat_seen[key].fill_(True)
            else:
                g.stat_totals[key].index_add_(0, idx, value)
                g.stat_seen[key].index_fill_(0, idx, True)

    @staticmethod
    def _clipped(g: _Group, grads, s: TrainSettings) -> list[tuple[str, torch.Tensor]]:
        """(name, gradient) of the leaves that have one (torch skips a None gradient), each
        client's scaled by its own ``clip_grad_norm`` factor when the settings clip."""
        pairs = [(n, gr) for n, gr in zip(g.leaves, grads) if gr is not None]
        if pairs and s.clip_grad_norm is not None:
            m = pairs[0][1].shape[0]
            norms = torch.stack([torch.linalg.vector_norm(gr.reshape(m, -1), dim=1) for _, gr in pairs])
            coef = clip_coefficient(norms, s.clip_grad_norm)
            pairs = [(n, gr * coef.view(m, *[1] * (gr.dim() - 1))) for n, gr in pairs]
        return pairs

    def _adam(self, g: _Group, w: dict, grads, idx, s: TrainSettings, active: torch.Tensor | None = None) -> None:
        """The Adam kernel of local training (:class:`fedhet.training.optim.Adam`: L2 weight decay,
        optional amsgrad) + ``clip_grad_norm``, per client, on stacked tensors, from a fresh state.
        Every member of a step takes its step number ``it + 1`` (one step per client per
        iteration), whose bias corrections are in ``g.adam_now``. ``active``: see :meth:`_step`."""
        pairs = self._clipped(g, grads, s)
        if not pairs:
            return
        opt = g.optimizer
        assert isinstance(opt, Adam) and g.adam_now is not None
        step_size, bias2_sqrt = g.adam_now[0], g.adam_now[1]
        full = idx is None
        for n, gr in pairs:
            p = w[n]
            slots = [g.adam_m, g.adam_v] + ([g.adam_vmax] if opt.amsgrad else [])
            # moments() updates them in place: a wide step works on copies and keeps the active rows
            exp_avg, exp_avg_sq, *vmax = [d[n].clone() if active is not None else d[n] if full
                                          else d[n].index_select(0, idx) for d in slots]
            denom = opt.moments(p, gr, exp_avg, exp_avg_sq, vmax[0] if vmax else None, bias2_sqrt)
            update = exp_avg.mul(step_size).div_(denom)
            p.sub_(update if active is None else _only(active, update))     # addcdiv_(exp_avg, denom, value=-step_size)
            if active is not None:
                for d, t in zip(slots, [exp_avg, exp_avg_sq, *vmax]):
                    _keep(active, d[n], t)
            elif not full:
                for d, t in zip(slots, [exp_avg, exp_avg_sq, *vmax]):
                    d[n].index_copy_(0, idx, t)
            g.adam_seen.add(n)

    def _sgd(self, g: _Group, w: dict, grads, idx, s: TrainSettings, active: torch.Tensor | None = None) -> None:
        """The SGD kernel of local training (:class:`fedhet.training.optim.SGD`: weight decay,
        momentum with dampening / Nesterov) + its ``clip_grad_norm``, per client, on stacked tensors.

        Only the first-step rule is per client: a client without a buffer yet starts it from
        its gradient (``had`` mask), as ``torch.optim.SGD`` does. ``active``: see :meth:`_step`."""
        pairs = self._clipped(g, grads, s)
        if not pairs:
            return
        opt = g.optimizer
        for n, gr in pairs:
            p = w[n]
            if s.momentum > 0:
                full = idx is None
                buf = g.momentum[n] if full else g.momentum[n].index_select(0, idx)
                had = g.has_momentum[n] if full else g.has_momentum[n].index_select(0, idx)
                d, buf = opt.direction(p, gr, buf, had.view(gr.shape[0], *[1] * (gr.dim() - 1)))
                if active is not None:      # direction() leaves the old buffer as it was
                    _keep(active, g.momentum[n], buf)
                    g.has_momentum[n] |= active
                elif full:
                    g.momentum[n].copy_(buf)
                    g.has_momentum[n].fill_(True)
                else:
                    g.momentum[n].index_copy_(0, idx, buf)
                    g.has_momentum[n].index_fill_(0, idx, True)
            else:
                d, _ = opt.direction(p, gr, None)
            p.add_(d if active is None else _only(active, d), alpha=-opt.lr)

    def _finish(self, g: _Group, C: int) -> None:
        """Unstack the group into one LocalResult per client (accounting like ``train_local``)."""
        rows = [[] for _ in range(C)]                     # per client: (loss, parts, batch size) per step
        if g.records:   # one device->host copy for the whole loop, not a sync per step
            all_losses = torch.cat([r[2] for r in g.records]).cpu().tolist()
            all_parts = torch.cat([r[3] for r in g.records]).cpu().tolist()
            k = 0
            for row_clients, size, _, _ in g.records:
                for i in row_clients:
                    if i is not None:           # None: a stand-in row of a wide step
                        rows[i].append((all_losses[k], all_parts[k], size))
                    k += 1
        names = [t.name for t in g.templates]
        # Which clients' weights are all finite, for the whole group in one reduction and one copy to
        # the host (check_finite per client would wait for the device once per tensor and client).
        finite = torch.ones(C, dtype=torch.bool, device=self.device)
        for t in g.weights.values():
            if t.is_floating_point() and t.numel():
                low, high = torch.aminmax(t.detach().reshape(C, -1), dim=1)
                finite &= torch.isfinite(low) & torch.isfinite(high)
        finite_on_host = finite.cpu().tolist()
        # Results go where the clients' code runs: the host's device (the CPU, or this device).
        dest = g.requests[0].client.host.device
        out = {n: t.detach().to(dest) for n, t in g.weights.items()}
        moms = {n: (t.detach().to(dest), g.has_momentum[n].cpu()) for n, t in g.momentum.items()}
        adam_slots = [("exp_avg", g.adam_m), ("exp_avg_sq", g.adam_v)] + \
            ([("max_exp_avg_sq", g.adam_vmax)] if g.adam_vmax else [])
        adam = {n: [(slot, d[n].detach().to(dest)) for slot, d in adam_slots] for n in g.leaves if n in g.adam_seen}
        stats = {k: (t.detach().to(dest), g.stat_seen[k].cpu()) for k, t in g.stat_totals.items()}
        for i, req in enumerate(g.requests):
            where = req.client.where()
            s = req.settings
            n = len(req.client.data.train_idx)
            per_epoch = n // s.batch_size if s.drop_last else -(-n // s.batch_size)
            loss_sum, part_sums, samples = 0.0, {}, 0
            for step, (value, parts, size) in enumerate(rows[i]):
                named = dict(zip(names, parts))           # a repeated name keeps the last term, as total_loss
                if not math.isfinite(value):
                    req.error = NumericalError(
                        f"non-finite loss ({value}) {where} at local epoch {req.start_epoch + step // per_epoch}, "
                        f"step {step}; loss parts: {named}. Lower the learning rate or check the method's "
                        f"hyper-parameters; the run directory keeps every round recorded so far.")
                    break
                loss_sum += value
                samples += size
                for k, v in named.items():
                    part_sums[k] = part_sums.get(k, 0.0) + v
            if req.error is not None:
                continue
            steps = len(rows[i])
            weights = {name: out[name][i].clone() for name in g.names}
            if not finite_on_host[i]:
                try:
                    check_finite(weights, where)        # names the first non-finite tensor
                except NumericalError as e:
                    req.error = e
                    continue
            opt_state = {name: buf[i].clone() for name, (buf, has) in moms.items() if bool(has[i])}
            for name, slots in adam.items():     # torch.optim.Adam's slots, in its order (optim.Adam.export)
                opt_state[f"{name}/step"] = torch.tensor(float(steps), dtype=torch.float32)
                for slot, t in slots:
                    opt_state[f"{name}/{slot}"] = t[i].clone()
            statistics = {k: t[i].clone() for k, (t, seen) in stats.items() if bool(seen[i])}
            req.result = LocalResult(weights, opt_state, steps, samples, loss_sum / max(steps, 1),
                                     {k: v / max(steps, 1) for k, v in part_sums.items()}, statistics)
