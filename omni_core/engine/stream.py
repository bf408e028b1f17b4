"""Per-request output stream: fed from the engine thread, read by a blocking or an asyncio consumer.

The stream is not bound to a loop when it is made, so the same admission call serves both kinds of reader:
``get()`` waits on a condition, ``aget()`` parks a future of the calling loop that ``put`` wakes.

A final output's post-processing (tensor -> PIL, a model's upscaling) runs when the reader takes it, in the
reader's thread (``put(out, finish=...)``): never on the engine's loop, which would hold up the next denoising step
of the others (about 1 ms per finished image on the 2-core CI machine, ``bench/hot_path.py``), and with no
delivery thread of its own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger("omni_core.engine")


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class OutputStream:
    """A thread-safe FIFO of one request's outputs, for one reader at a time (blocking or asyncio)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, item: Any, finish: Callable[[Any], Any] | None = None) -> None:
        """Thread-safe; a waiting reader whose loop has closed is simply not woken. ``finish(item)`` runs when the
        reader takes the item (a failure makes it an error output)."""
        with self._cond:
            self._items.append((item, finish))
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
            item = self._items.popleft()
        return _finished(*item)

    async def aget(self) -> Any:
        """The next item, awaited on the running loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    item = self._items.popleft()
                    break
                if self._waiter is not None and not self._waiter[1].done():
                    # one waiter slot: a second concurrent reader would leave the first waiting forever
                    raise RuntimeError("this output stream already has an async reader waiting; read a request's "
                                       "outputs from one task")
                future = loop.create_future()
                self._waiter = (loop, future)
            await future
        return _finished(*item)


def _finished(item: Any, finish: Callable[[Any], Any] | None) -> Any:
    if finish is None:
        return item
    from omni_core.platforms.threads import one_torch_thread

    try:
        with one_torch_thread():
            return finish(item)
    except BaseException as exc:  # noqa: BLE001 - the request fails; the reader gets its output
        logger.debug("post-processing failed", exc_info=True)
        item.status, item.error = "error", f"post-processing failed: {type(exc).__name__}: {exc}"
        return item
