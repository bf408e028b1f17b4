"""Per-request output stream: fed from the engine thread, read by a blocking or an asyncio consumer.

The stream is not bound to a loop when it is made, so the same admission call serves both kinds of reader:
``get()`` waits on a condition, ``aget()`` parks a future of the calling loop that ``put`` wakes.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from typing import Any


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class OutputStream:
    """A thread-safe FIFO of one request's outputs, for one reader at a time (blocking or asyncio)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, item: Any) -> None:
        """Thread-safe; a waiting reader whose loop has closed is simply not woken."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # the reader's loop is closed
                pass

    def get(self, timeout: float | None = None) -> Any:
        """The next item; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise queue.Empty
            return self._items.popleft()

    async def aget(self) -> Any:
        """The next item, awaited on the running loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                if self._waiter is not None and not self._waiter[1].done():
                    # one waiter slot: a second concurrent reader would leave the first waiting forever
                    raise RuntimeError("this output stream already has an async reader waiting; read a request's "
                                       "outputs from one task")
                future = loop.create_future()
                self._waiter = (loop, future)
            await future
