"""The deadline watcher: a request with ``SamplingParams.timeout`` ends within one step of its deadline, whatever
the busy loop is waiting on (a wave's result, a whole request-mode wave).

One thread, sharing the engine's lock; idle (no CPU) while no request has a deadline. Its final output is a
timeout error (``DiffusionEngine._finalize``).
"""

from __future__ import annotations

import threading
import time
from typing import Any



class DeadlineWatcher:
    """The watcher of one ``DiffusionEngine`` (``engine``): it shares the engine's lock and request table."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: request id -> deadline, for the requests that have one (until it passes)
        self.deadlines: dict[str, float] = {}
        #: wakes the watcher when a deadline is added or the engine closes or dies
        self.wake = threading.Condition(engine._lock)
        self.thread = threading.Thread(target=self._watch, name="omni-deadlines", daemon=True)

    def add(self, request_id: str, deadline: float) -> None:
        """Watch ``request_id`` until ``deadline`` (``time.monotonic()``; lock held)."""
        self.deadlines[request_id] = deadline
        self.wake.notify()

    def discard(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)

    def _watch(self) -> None:
        e = self.engine
        with e._lock:
            while not e._closed and not e._dead:
                if not self.deadlines:
                    self.wake.wait()
                    continue
                delay = min(self.deadlines.values()) - time.monotonic()
                if delay > 0:
                    self.wake.wait(delay)
                    continue
                running = self._expire()
                if running:  # step mode: the next wave leaves them out (mp: one replacing the queued wave now)
                    e._steps.send_now()
                    e.mode.stop_running(e.executor, running)  # request mode: the runner stops them

    def _expire(self) -> list[str]:
        """End the requests past their deadline (lock held): a waiting one now, a running one at the next step
        (the returned ids: request mode must tell the runner, ``mode.stop_running``)."""
        e, now, running = self.engine, time.monotonic(), []
        for rid, deadline in list(self.deadlines.items()):
            if deadline > now:
                continue
            del self.deadlines[rid]
            record = e._records.get(rid)
            if record is None or record.timed_out:
                continue
            record.timed_out = True
            if e._end(rid):
                running.append(rid)
        if running:
            e._wake.notify()
        return running


__all__ = ["DeadlineWatcher"]
