"""Final-output delivery off the busy loop: post-processing (tensor -> PIL, a model's upscaling) runs on
its own thread, so a finishing request never holds up the next denoising step of the others.

Measured on the 2-core CI machine with ``shapes`` (``bench/hot_path.py``): converting a finished image took
about 1 ms of the engine thread; at queue depth 64 in step mode, where some request finishes in most
waves, that was most of the engine's own time per step.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger("omni_core.engine")


class OutputDelivery:
    """A queue and one daemon thread: ``deliver(stream, out, post_process)`` post-processes ``out`` there
    and puts it on ``stream``, in the order given."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="omni-delivery", daemon=True)
        self._thread.start()

    def deliver(self, stream: Any, out: Any, post_process: Callable[[Any], Any] | None) -> None:
        if post_process is None:
            stream.put(out)
        else:
            self._queue.put((stream, out, post_process))

    def _run(self) -> None:
        from omni_core.platforms.threads import one_thread_here

        while True:
            item = self._queue.get()
            if item is None:
                return
            one_thread_here()  # before each item: torch may have been loaded since the last one
            stream, out, post_process = item
            try:
                out = post_process(out)
            except BaseException as exc:  # noqa: BLE001 - the request fails, delivery goes on
                out.status, out.error = "error", f"post-processing failed: {type(exc).__name__}: {exc}"
            stream.put(out)

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued, then stop the thread."""
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
