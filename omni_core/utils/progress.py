"""Start-up progress lines of the ``omni`` commands: one line per stage on stderr (``omni generate: loading
shapes ...``, ``... warming up ...``, ``... ready in 6.1 s``), so a start-up of many seconds is not silent.

Off unless a command turns it on (:func:`enable`): the engine calls :func:`progress` at its stages, and a
program that uses ``Omni`` as a library prints nothing it did not ask for.
"""

from __future__ import annotations

import contextlib
import sys
import time

_state: dict = {"prefix": None, "t0": 0.0}


def enable(prefix: str) -> None:
    """Print progress lines prefixed ``prefix:`` from now on (and start the clock that :func:`elapsed` reads)."""
    _state.update(prefix=prefix, t0=time.perf_counter())


def disable() -> None:
    _state["prefix"] = None


@contextlib.contextmanager
def shown(prefix: str):
    """Start-up progress lines on while a command runs (``omni generate``, ``omni serve``), off after."""
    enable(prefix)
    try:
        yield
    finally:
        disable()


def elapsed() -> float:
    """Seconds since :func:`enable`."""
    return time.perf_counter() - _state["t0"]


def progress(message: str) -> None:
    """One line on stderr when a command enabled progress; nothing otherwise."""
    if _state["prefix"]:
        print(f"{_state['prefix']}: {message}", file=sys.stderr, flush=True)
