"""Request deadlines (``SamplingParams.timeout``), kept by the engine's loop.

The loop waits on its inbox with the next deadline as its timeout and ends what is due (``EngineCore._expire``):
a request ends within one step of its deadline, whatever the loop waits on, with no thread of its own. A
request's deadline lives on its record (``RequestRecord.deadline``, the one per-request table); this is only the
order in which they come due.
"""

from __future__ import annotations

import heapq
from typing import Callable


class Deadlines:
    """A heap of ``(deadline, request id)``; ``watched(request_id, deadline)`` says whether an entry still counts
    (the request has not ended), so an ended request needs no removal."""

    def __init__(self, watched: Callable[[str, float], bool]) -> None:
        self._watched = watched
        self._heap: list[tuple[float, str]] = []

    def add(self, request_id: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, request_id))

    def next_due(self) -> float | None:
        """The earliest deadline still watched, or None."""
        heap = self._heap
        while heap and not self._watched(heap[0][1], heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[str]:
        """The ids whose deadline has passed (each once)."""
        due = []
        while (deadline := self.next_due()) is not None and deadline <= now:
            due.append(heapq.heappop(self._heap)[1])
        return due


__all__ = ["Deadlines"]
