"""Collective calls waiting for the engine's loop (``DiffusionEngine.collective_rpc``).

While one is pending or running no new wave is sent; it starts once the waves in flight are back, runs on the
executor's call thread (``executor.collective_rpc``: every rank, :mod:`omni_core.executor.collective`), and its
result comes back through the loop's inbox like a wave's. Owned by the loop (``EngineCore``); kept apart so the
core stays one loop and one table.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable


class CollectiveCalls:
    def __init__(self) -> None:
        self._waiting: collections.deque = collections.deque()
        self._running: concurrent.futures.Future | None = None

    @property
    def active(self) -> bool:
        """A call waits or runs: waves pause."""
        return bool(self._waiting) or self._running is not None

    def add(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> concurrent.futures.Future:
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._waiting.append((method, args, kwargs, timeout, reply))
        return reply

    def start_next(self, executor: Any, post: Callable[..., None]) -> None:
        """Start the next call (the caller checked that no wave is in flight); its end is posted to the loop."""
        if self._running is not None or not self._waiting:
            return
        method, args, kwargs, timeout, reply = self._waiting.popleft()
        self._running = reply
        executor.run_async(lambda: executor.collective_rpc(method, args, kwargs, timeout),
                           lambda result, error: post(self.done, reply, result, error))

    def done(self, reply: concurrent.futures.Future, result: Any, error: BaseException | None) -> None:
        self._running = None
        if error is None:
            reply.set_result(result)
        else:
            reply.set_exception(error)

    def fail_all(self, error: BaseException) -> None:
        """The loop stops: every call not answered yet gets ``error``."""
        replies = [call[-1] for call in self._waiting] + ([self._running] if self._running is not None else [])
        self._waiting.clear()
        self._running = None
        for reply in replies:
            if not reply.done():
                reply.set_exception(error)


__all__ = ["CollectiveCalls"]
