"""Where an exception was raised, in one line: the worker puts it on a failed request's output and the engine
names it when the start-up warm-up fails (both need it; neither should import the other for it)."""

from __future__ import annotations

import traceback


def innermost_frame(exc: BaseException) -> str | None:
    """``file:line in function`` where ``exc`` was raised (the innermost traceback frame), or None."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None


__all__ = ["innermost_frame"]
