"""The baton: each client's ordinary ``client_update`` runs in its own thread, and its
``client.train(...)`` posts a :class:`TrainRequest` and blocks until the engine has served it.

Only one thread runs at a time (the engine hands a baton to one client and waits until it gives it
back), so client code never runs concurrently and results do not depend on thread timing. When
every client of a phase is blocked in ``train`` or finished, the engine serves the pending requests
together.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedhet.core.contract import Arrays, ClientData, LocalResult, TrainSettings
from fedhet.engine.host import ClientHost, JobResult, SimClient, Tally
from fedhet.training.objective import LossTerm


@dataclass
class TrainRequest:
    """One client's ``train`` call, waiting for the engine; ``result`` or ``error`` is its answer."""

    client: VecClient
    weights: Arrays
    terms: list[LossTerm]
    settings: TrainSettings
    data: ClientData                   # the data view it trains on (the client's own, or another: KT-pFL)
    stream: str                        # the client's random stream its batches come from
    start_epoch: int
    trainable: Callable[[str], bool] | None
    optimizer_state: Arrays | None
    augment: Callable | None
    statistics: dict[str, torch.Tensor] | None = None
    result: LocalResult | None = None
    error: BaseException | None = None


# How often the engine thread, waiting for a client to give the baton back, looks for a pending
# interrupt: the longest a Ctrl-C can wait before it is raised.
BATON_POLL_S = 0.05


class PhaseAbandoned(Exception):
    """Raised inside a blocked client thread when its phase is abandoned (another client failed,
    or the run was interrupted)."""


class ClientTask:
    """One client's ``client_update`` in its own thread, run only while the engine waits.

    ``resume`` hands the baton to the client and returns when it blocks in ``train`` (then
    ``request`` is set) or finishes (``done``).
    """

    def __init__(self, fn: Callable[[ClientTask], JobResult]):
        self._fn = fn
        self._go: queue.SimpleQueue = queue.SimpleQueue()
        self._back: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self.started = False
        self.request: TrainRequest | None = None
        self.done = False
        self.output: Any = None           # the client's JobResult
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
                raise PhaseAbandoned("phase abandoned before this client ran")
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
        self._wait_for_baton_back()

    def _wait_for_baton_back(self) -> None:
        # Polls rather than blocking for good: a Ctrl-C or SIGTERM that arrives while the engine
        # thread is still on its way into the wait (waiting for the GIL, not yet blocked) interrupts
        # nothing, and a plain get() would only raise it once the client gives the baton back.
        while True:
            try:
                self._back.get(timeout=BATON_POLL_S)
                return
            except queue.Empty:
                pass

    def wait(self, request: TrainRequest) -> LocalResult:
        """Client side: post ``request``, give the baton back, return its result when resumed."""
        self.request = request
        self._back.put(None)
        self._take_baton()
        self.request = None
        if request.error is not None:
            raise request.error
        # the engine set the result, or the error raised above
        return request.result  # type: ignore[return-value]

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
                    self.request.error = PhaseAbandoned(
                        "phase abandoned: another client failed or the run was interrupted")
                else:
                    self._abort = True
                self._hand_baton()
            try:
                self._back.get(timeout=BATON_POLL_S)
            except queue.Empty:
                pass
        self._thread.join()


class VecClient(SimClient):
    """A :class:`SimClient` whose ``train`` is served by the engine, possibly vectorized."""

    def __init__(self, host: ClientHost, cid: int, rnd: int, tally: Tally, task: ClientTask,
                 on_own_loop: Callable[[LocalResult], None] | None = None):
        super().__init__(host, cid, rnd, tally)
        self._task = task
        self._on_own_loop = on_own_loop
        self._served: LocalResult | None = None

    def fit(self, weights: Arrays, terms: list[LossTerm], settings: TrainSettings, *, data: ClientData, stream: str,
            start_epoch: int, trainable: Callable[[str], bool] | None, optimizer_state: Arrays | None,
            augment: Callable | None, statistics: dict[str, torch.Tensor] | None) -> LocalResult:
        self._served = self._task.wait(TrainRequest(self, weights, terms, settings, data, stream, start_epoch,
                                                    trainable, optimizer_state, augment, statistics))
        return self._served

    def account(self, result: LocalResult) -> None:
        """A result the engine did not serve was trained in the method's own loop (Per-FedAvg's
        meta steps), one client at a time: reported, so that it is counted as not vmapped."""
        if result is not self._served and result.steps and self._on_own_loop is not None:
            self._on_own_loop(result)
        super().account(result)
