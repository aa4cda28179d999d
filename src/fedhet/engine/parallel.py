"""The client-parallel engine: each phase's clients train in N worker processes.

On a CPU, intra-op parallelism at the batch sizes of FL clients (10-64) leaves cores idle, so
:class:`Forked` runs whole clients side by side instead: N forked worker processes
with one intra-op thread each (docs/performance.md has the measurements).

It is a transport of the one round loop (:mod:`fedhet.engine.loop`): the server generator,
aggregation, evaluation, the communication ledger and every client's persistent state stay in
the parent. A worker is stateless between calls: it receives a :class:`fedhet.engine.host.Job`,
runs it through the same :class:`fedhet.engine.host.ClientHost` the reference uses, and returns
the :class:`fedhet.engine.host.JobResult`. So a worker holds nothing that a checkpoint could
miss, and a multi-phase round (FedCME) carries its mid-round client state through the parent
like any other state.

Results are bit-identical to the reference engine run with one intra-op thread: a client's
computation is a pure function of its inputs and its random streams (keyed by seed, round and
client), every tensor travels as its exact bytes, and the parent applies the replies, client
states and per-client loss statistics in the phase's order, as the reference does.

Data is not copied per round: workers are forked once, after the federation is built, and read
its uint8 pools copy-on-write. Per call only the message and the client's state travel; a
tensor that several of a phase's calls share (the global model, FedCME's global model inside
every mid-round state) goes to each worker once per phase and comes back as a reference, so
the parent keeps one object, as in the reference engine.

Workers are forked (not spawned): no re-import, no pickling of the algorithm or the data. A
process forked after torch has run OpenMP regions must not use more than one OpenMP thread
(libgomp hangs), which is why the workers are pinned to one thread - the design wanted that
anyway. The engine is CPU-only (CUDA cannot be forked).
"""

from __future__ import annotations

import atexit
import functools
import io
import multiprocessing as mp
import pickle
import signal
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from fedhet.core.contract import Message
from fedhet.engine.host import ClientHost, Job, JobResult
from fedhet.engine.loop import Transport

# --- exact, fast tensor transport -------------------------------------------------------
# Python's default tensor pickling serialises each storage through torch.save, far slower than
# copying its bytes; a plain CPU tensor is sent as its raw bytes instead (protocol 5 buffers),
# which is exact.


def _rebuild_tensor(buf, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    if len(buf):
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    else:
        t = torch.empty(shape, dtype=dtype)
    return t.requires_grad_(True) if requires_grad else t


def _plain_cpu(obj) -> bool:
    return type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu" \
        and obj.grad_fn is None and not obj.is_quantized


class _Pickler(pickle.Pickler):
    """Tensors as raw bytes; tensors in ``shared`` (by id) as references to a per-phase table."""

    def __init__(self, file, shared: dict[int, int] | None = None):
        super().__init__(file, protocol=5)
        self.shared = shared or {}

    def persistent_id(self, obj):
        if self.shared and isinstance(obj, torch.Tensor):
            return self.shared.get(id(obj))
        return None

    def reducer_override(self, obj):
        if _plain_cpu(obj):
            t = obj.detach().contiguous()
            data = pickle.PickleBuffer(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
            return _rebuild_tensor, (data, t.dtype, tuple(t.shape), obj.requires_grad)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, table: list | None = None):
        super().__init__(file)
        self.table = table or []

    def persistent_load(self, pid):
        return self.table[pid]


def dumps(obj, shared: dict[int, int] | None = None) -> bytes:
    f = io.BytesIO()
    _Pickler(f, shared).dump(obj)
    return f.getvalue()


def loads(data: bytes, table: list | None = None):
    return _Unpickler(io.BytesIO(data), table).load()


def _tensors(obj, out: list) -> None:
    """Every tensor inside messages, states and nested containers."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Message):
        _tensors(obj.arrays, out)
        _tensors(obj.scalars, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def shared_tensors(items) -> list[torch.Tensor]:
    """Tensors that occur in more than one of ``items`` (each counted once per item)."""
    seen: dict[int, int] = {}
    keep: dict[int, torch.Tensor] = {}
    for item in items:
        found: list[torch.Tensor] = []
        _tensors(item, found)
        for t in {id(t): t for t in found}.values():
            seen[id(t)] = seen.get(id(t), 0) + 1
            if seen[id(t)] == 2 and _plain_cpu(t):
                keep[id(t)] = t
    return list(keep.values())


# --- errors -----------------------------------------------------------------------------
class WorkerError(RuntimeError):
    """A worker process failed outside the client's code (died, or sent an unreadable error)."""


class RemoteTraceback(Exception):
    """The worker-side traceback, attached as ``__cause__`` of an exception raised in a worker."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n(in the worker process)\n{self.tb}"


def _kill_workers(pool: list[_Worker]) -> None:
    for w in pool:
        if w.process.is_alive():
            w.process.kill()


# --- the worker -------------------------------------------------------------------------
_STOP = b"stop"


def _worker_main(host: ClientHost, conn, inherited) -> None:
    for c in inherited:          # other workers' pipe ends: closing them lets EOF mean "parent gone"
        c.close()
    # Ctrl-C and SIGTERM are the parent's to handle, also when sent to every process (a terminal's
    # Ctrl-C, a service manager's stop): the parent lets the round end (fedhet.cli), which needs its
    # workers. A worker ends on the parent's "stop", at the parent's end (EOF) or killed by it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    table: list = []
    table_ids: dict[int, int] = {}
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if data == _STOP:
            return
        kind, body = loads(data, table)
        if kind == "shared":
            table = loads(body)
            table_ids = {id(t): i for i, t in enumerate(table)}
            continue
        rnd, job = body
        try:
            out = dumps(("ok", host.run(rnd, job)), table_ids)
        except Exception as e:
            tb = traceback.format_exc()
            try:
                exc = dumps(e)
                loads(exc)
            except Exception:
                exc = None
            out = dumps(("error", (exc, f"{type(e).__name__}: {e}", tb)))
        del job
        conn.send_bytes(out)


class _Worker:
    def __init__(self, process, conn):
        self.process = process
        self.conn = conn


class Forked(Transport):
    """A transport whose phases run their clients in ``workers`` forked processes.

    The processes start with the first phase and live until :meth:`close` (or the end of the
    program); an error in a client's code (a :class:`fedhet.core.errors.NumericalError`, a bug) is
    re-raised in the parent with its type and message, the worker's traceback as its cause, and
    the pool shut down (the next phase starts a fresh one).
    """

    name = "parallel"

    def __init__(self, workers: int = 2):
        if int(workers) < 1:
            raise ValueError(f"run.workers must be at least 1, got {workers}")
        self.workers = int(workers)
        self._pool: list[_Worker] | None = None
        self._at_exit: Callable[[], None] | None = None      # kills the pool at exit if never closed

    def info(self) -> dict:
        return {"engine": self.name, "workers": self.workers}

    # --- pool -----------------------------------------------------------------------------
    def _start(self) -> list[_Worker]:
        if self._pool is not None:
            return self._pool
        if not fork_available():
            raise RuntimeError("the parallel engine needs the 'fork' start method (Linux); use run.engine: reference")
        ctx = mp.get_context("fork")
        pool: list[_Worker] = []
        try:
            for i in range(self.workers):
                parent_end, child_end = ctx.Pipe(duplex=True)
                inherited = [w.conn for w in pool] + [parent_end]
                p = ctx.Process(target=_worker_main, args=(self.host, child_end, inherited), daemon=True,
                                name=f"fedhet-worker-{i}")
                with warnings.catch_warnings():
                    # Python >= 3.12 warns about forking a multi-threaded process: torch's OpenMP
                    # pool is the only other thread here, and the workers never use it.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    p.start()
                child_end.close()
                pool.append(_Worker(p, parent_end))
        except BaseException:
            self._pool = pool
            self.close(wait=False)
            raise
        self._pool = pool
        # At exit, multiprocessing terminates daemon workers with SIGTERM, which they ignore, and waits
        # for them: a pool never closed is killed first (atexit runs the later registration first).
        self._at_exit = functools.partial(_kill_workers, pool)
        atexit.register(self._at_exit)
        return pool

    def close(self, wait: bool = True) -> None:
        """Stop the worker processes (``wait``: let them finish; else kill them at once: they ignore
        SIGTERM)."""
        pool, self._pool = self._pool, None
        if not pool:
            return
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        for w in pool:
            if wait:
                try:
                    w.conn.send_bytes(_STOP)
                except OSError:
                    pass
        for w in pool:
            if wait:
                w.process.join(timeout=5)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5)
            w.conn.close()

    def __del__(self):
        try:
            self.close(wait=False)
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(wait=exc[0] is None)

    # --- phases -----------------------------------------------------------------------------
    def deliver(self, rnd: int, jobs: list[Job]) -> dict[int, JobResult]:
        """Every job in the workers; results returned by client id (the loop applies them in order)."""
        if not jobs:
            return {}
        table = shared_tensors([(job.message, job.state) for job in jobs])
        table_ids = {id(t): i for i, t in enumerate(table)}
        table_msg = dumps(("shared", dumps(table)))
        # Largest clients first, each to the next free worker: the phase ends with the last
        # client, so long jobs must not start last.
        sizes = self.host.federation.train_idx
        pending = deque(sorted(range(len(jobs)), key=lambda i: -len(sizes[jobs[i].cid])))
        results: dict[int, JobResult] = {}
        pool = self._start()
        idle = list(pool)
        busy: dict[object, tuple[_Worker, int]] = {}
        has_table: set[int] = set()
        try:
            while pending or busy:
                while pending and idle:
                    w = idle.pop()
                    i = pending.popleft()
                    job = jobs[i]
                    if id(w) not in has_table:
                        w.conn.send_bytes(table_msg)
                        has_table.add(id(w))
                    try:
                        data = dumps(("job", (rnd, job)), table_ids)
                    except Exception as e:
                        raise WorkerError(f"the message or state of client {job.cid} cannot be sent to a worker "
                                          f"process ({type(e).__name__}: {e}); messages and client states must "
                                          f"hold tensors and plain Python values") from e
                    w.conn.send_bytes(data)
                    busy[w.conn] = (w, i)
                    busy[w.process.sentinel] = (w, i)
                for ready in wait(list(busy)):
                    if ready not in busy:
                        continue
                    w, i = busy[ready]
                    try:
                        data = w.conn.recv_bytes() if ready is w.conn or w.conn.poll() else None
                    except (EOFError, OSError):
                        data = None
                    if data is None:
                        raise WorkerError(f"worker process {w.process.pid} died (exit code {w.process.exitcode}) "
                                          f"while client {jobs[i].cid} trained in round {rnd + 1}; if the machine ran "
                                          f"out of memory, use fewer run.workers")
                    del busy[w.conn], busy[w.process.sentinel]
                    idle.append(w)
                    status, body = loads(data, table)
                    if status == "error":
                        raise self._remote_error(*body)
                    results[jobs[i].cid] = body
        except BaseException:
            self.close(wait=False)
            raise
        return results

    @staticmethod
    def _remote_error(exc_bytes, text: str, tb: str) -> BaseException:
        exc = None
        if exc_bytes is not None:
            try:
                exc = loads(exc_bytes)
            except Exception:
                exc = None
        if not isinstance(exc, BaseException):
            exc = WorkerError(text)
        exc.__cause__ = RemoteTraceback(tb)
        return exc


def fork_available() -> bool:
    return "fork" in mp.get_all_start_methods()

