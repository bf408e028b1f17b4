"""The core loop's inbox: how other threads hand work to the one thread that owns the engine's state.

``post`` queues a call nobody waits for, ``call`` one whose result (or exception) the caller waits for; the loop's
``drain`` runs them in posting order. A bad posted event is logged and dropped, never allowed to stop the loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from typing import Any, Callable

logger = logging.getLogger("omni_core.engine")


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        self._queue.put((fn, args, None))

    def call(self, fn: Callable[..., Any], args: tuple, stopped: Callable[[], bool]) -> Any:
        """Queue ``fn(*args)`` and wait for its result; once ``stopped()`` (the loop will never drain again) and
        it was not run, it runs here."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, args, reply))
        while True:
            try:
                return reply.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if stopped() and not reply.done():  # posted after the loop's last drain
                    return fn(*args)

    def drain(self, timeout: float) -> None:
        """Run the events posted since the last drain, waiting up to ``timeout`` for the first."""
        try:
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            _run(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return


def _run(item: tuple) -> None:
    fn, args, reply = item
    if reply is None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad event must not stop the loop
            logger.exception("an engine event failed")
        return
    try:
        reply.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        reply.set_exception(exc)


__all__ = ["Inbox"]
