"""Weight operations as the engine's callers see them (issue #52): what happens to requests while weights change.

An update (``update_weights``) runs on every rank through the collective call (``omni_core.worker.weights``). Around
it, the requests the engine holds either finish on the old weights (``in_flight="finish"``: new submissions wait at
the gate until the update is done, the ones already queued or running complete first) or are aborted
(``in_flight="abort"``: each caller gets its aborted output at once). ``release_memory`` closes the gate until
``resume_memory``: a submission meanwhile is refused at once, naming the call that reopens it. Every caller gets an
answer: a submission waits at most ``wait_s`` for an update to end, then is refused.

Why a gate in the front end rather than in the core's loop: it holds callers, not engine state (the core's table and
waves are untouched: draining is waiting for the core to hold no request).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from omni_core.errors import ConfigError, OmniError

IN_FLIGHT = ("finish", "abort")


class WeightGate:
    """Open, updating (submissions wait), or released (submissions are refused)."""

    def __init__(self, wait_s: float = 300.0) -> None:
        self.wait_s = wait_s
        self._open = threading.Event()
        self._open.set()
        self._one = threading.Lock()  # one weight operation at a time
        self.released = False

    def admit(self) -> None:
        """Called by each submission before it reaches the core."""
        if self.released:
            raise OmniError("the model's memory is released (release_memory): call resume_memory before submitting")
        if not self._open.wait(self.wait_s):
            raise OmniError(f"the model's weights were still being updated after {self.wait_s:.0f} s; retry")
        if self.released:
            raise OmniError("the model's memory is released (release_memory): call resume_memory before submitting")

    def run(self, call: Callable[[], Any], *, request_ids: Callable[[], list[str]],
            abort: Callable[[list[str]], None], in_flight: str = "finish", timeout: float | None = None) -> Any:
        """``call()`` once no request is held (after aborting them all, with ``in_flight="abort"``)."""
        if in_flight not in IN_FLIGHT:
            raise ConfigError(f"in_flight={in_flight!r}: what happens to requests held during a weight operation: "
                              f"one of {', '.join(IN_FLIGHT)}", field="in_flight")
        with self._one:
            self._open.clear()
            try:
                if in_flight == "abort":
                    abort(request_ids())
                deadline = None if timeout is None else time.monotonic() + timeout
                while request_ids():
                    if deadline is not None and time.monotonic() > deadline:
                        raise OmniError(f"requests in flight did not finish within {timeout} s; nothing was "
                                        f"changed (use in_flight='abort' to end them)")
                    time.sleep(0.01)
                return call()
            finally:
                self._open.set()


__all__ = ["IN_FLIGHT", "WeightGate"]
