"""Per-request output stream, fed from the engine thread, read by sync or asyncio consumers."""

from __future__ import annotations

import asyncio
import queue
from typing import Any


class OutputStream:
    """A queue bound to the asyncio loop it was created in (if any), else a thread-safe queue."""

    def __init__(self, bind_loop: bool = True) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        if bind_loop:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        self._aq: asyncio.Queue | None = asyncio.Queue() if self._loop is not None else None
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        """Thread-safe; a closed consumer loop just drops the item."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:
                pass
        else:
            self._q.put(item)

    async def aget(self) -> Any:
        if self._aq is None:
            return await asyncio.get_running_loop().run_in_executor(None, self._q.get)
        return await self._aq.get()

    def get(self, timeout: float | None = None) -> Any:
        if self._aq is not None:
            raise RuntimeError("this stream belongs to an asyncio loop; use 'await stream.aget()'")
        return self._q.get(timeout=timeout)
