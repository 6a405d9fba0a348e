"""The engine's worker thread: ``HiggsTalker`` callers queue requests on the engine and wait on a ticket while
one thread (started on demand, gone when idle) steps the engine for all of them."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from .engine import Engine
from .results import GenerationError

logger = logging.getLogger(__name__)


class Ticket:
    """A caller waiting on some requests: woken when all have finished, and, if ``per_step``, after every step that
    leaves one of them with ``wake_rows`` rows or more (0: every step) or finds ``cancel`` set. A streaming caller
    that needs many frames at once (a codec chunk) so sleeps through the steps that make the frames before them: a
    thread woken every step per stream took the host (and its interpreter lock) from the engine's own thread."""

    def __init__(self, ids: list[str], per_step: bool) -> None:
        self.ids, self.per_step = ids, per_step
        self.wake_rows = 0
        self.cancel: threading.Event | None = None
        self.event = threading.Event()
        self.done = False
        self.error: BaseException | None = None  # the worker thread itself failed (a bug): nothing will finish

    def rearm(self, wake_rows: int) -> None:
        """Wake after the step that leaves ``wake_rows`` rows (see ``due``); a wake-up for an earlier need is dropped,
        so read the rows after this: a step that published them before it is seen there."""
        self.wake_rows = wake_rows
        self.event.clear()
        if self.error is not None:  # the worker thread died meanwhile: the next wait raises it
            self.event.set()

    def due(self, requests: dict) -> bool:
        """Whether a ``per_step`` caller is woken after this step (``requests``: the engine's, by id)."""
        if self.wake_rows <= 0 or (self.cancel is not None and self.cancel.is_set()):
            return True
        return any(len(requests[i].rows) >= self.wake_rows for i in self.ids if i in requests)

    def wait(self) -> None:
        """Until the next wake-up; raises if the worker thread died."""
        self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise GenerationError(f"the engine's worker thread failed: {self.error!r}") from self.error


class Driver:
    """Steps an engine on one worker thread while any caller waits (started on demand, exits when idle)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a ticket arrives or the thread exits
        self._tickets: list[Ticket] = []
        self._thread: threading.Thread | None = None

    def wait_for(self, ticket: Ticket) -> None:
        with self._lock:
            self._tickets.append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="higgs-talker-engine", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def withdraw(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket in self._tickets:
                self._tickets.remove(ticket)

    def settle(self) -> None:
        """Wait, unless a caller still waits, for the worker thread to end its step and exit (one step at most).

        An interrupted caller settles because the program may exit next: a daemon thread still inside a torch op
        while the interpreter shuts down is ended by a stack unwinding that C++ turns into an abort ("terminate
        called without an active exception"). The wait ends early if another caller's ticket arrives.
        """
        with self._lock:
            while self._thread not in (None, threading.current_thread()) and not self._tickets:
                self._changed.wait()

    @contextlib.contextmanager
    def held_idle(self, wait: bool) -> Iterator[bool]:
        """Keep the engine idle for the block: yields True once no worker thread runs and no caller waits (``wait``:
        until then; else False at once where one does), and no request is taken until the block ends."""
        with self._lock:
            while wait and (self._thread is not None or self._tickets):
                self._changed.wait()
            yield self._thread is None and not self._tickets

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a bug here must reach the waiting callers, not hang them
            logger.exception("the engine's worker thread failed")
            with self._lock:
                for ticket in self._tickets:
                    ticket.error = exc
                    ticket.event.set()
                self._tickets.clear()
                self._thread = None
                self._changed.notify_all()

    def _serve(self) -> None:
        engine = self.engine
        if engine.device.type == "cuda":
            torch.cuda.set_device(engine.device)
        while True:
            with self._lock:
                if not self._tickets:
                    self._thread = None
                    self._changed.notify_all()
                    return
            if engine.has_unfinished():
                try:
                    engine.step()
                except Exception as exc:  # noqa: BLE001 - the step's own requests carry it; serve the rest
                    logger.error("an engine step failed (its requests end with the error): %r", exc)
            with self._lock:
                for ticket in list(self._tickets):
                    if all(engine.requests[i].finished for i in ticket.ids if i in engine.requests):
                        ticket.done = True
                        self._tickets.remove(ticket)
                        ticket.event.set()
                    elif ticket.per_step and ticket.due(engine.requests):
                        ticket.event.set()
