"""The executor's call thread: waves run off the engine's loop, their results posted back to it.

The engine's loop never runs the model (:mod:`omni_core.engine.core`): it hands each wave to the executor with
``run_async(call, done)``; the call runs on this thread (the ``uni`` executor's model, or ``mp``'s wait for its
workers' results), and ``done(result, error)`` tells the loop, which posts it to its inbox. Calls run one at a
time in the order given, as the executor's synchronous methods expect. One thread per executor, started on the
first call, stopped by ``close``.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger("omni_core.executor")

DoneFn = Callable[[Any, "BaseException | None"], None]


class CallThread:
    """Runs ``call()`` then ``done(result, error)`` for each ``run`` on one daemon thread, in order."""

    def __init__(self, name: str = "omni-executor-calls") -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, call: Callable[[], Any], done: DoneFn) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((call, done))

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, done = item
            try:
                result, error = call(), None
            except BaseException as exc:  # noqa: BLE001 - handed to done
                result, error = None, exc
            try:
                done(result, error)
            except Exception:  # noqa: BLE001 - the thread serves the next call
                logger.exception("delivering a call's result failed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the calls already given (a call blocked on a dead worker fails once it is shut down)."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)


__all__ = ["CallThread", "DoneFn"]
