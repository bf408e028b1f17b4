"""Waiting in tests without sleeping longer than the condition needs, and without hanging when it never holds.

For suites that drive a running engine or server: poll a condition every 5 ms with a deadline that fails the
test naming what it waited for, and abort a request once it has run a few steps (the engine's abort contract).
"""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(condition: Callable[[], Any], what: str = "condition", timeout: float = 30.0) -> None:
    """Poll ``condition`` until it is true; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def abort_after_steps(engine: Any, request: Any, steps: int = 3, timeout: float = 60.0) -> tuple[Any, int]:
    """Submit ``request`` to ``engine``, abort it once ``steps`` denoising steps were reported, and return
    (what its handle or stream delivers, the last step seen before the abort)."""
    seen: list[int] = []
    (handle,) = engine.submit([request], on_progress=lambda rid, step, total: seen.append(step))
    wait_for(lambda: len(seen) >= steps, f"{steps} steps of {request.request_id} (saw {seen})", timeout)
    at_abort = seen[-1]
    engine.abort(request.request_id)
    return handle, at_abort


def sse_events(response: Any) -> list[tuple[str | None, dict]]:
    """The ``(event, data)`` pairs of a server-sent-events response (an httpx or requests response)."""
    import json

    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line[5:])))
    return events
