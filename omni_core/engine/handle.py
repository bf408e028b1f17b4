"""``RequestHandle``: what ``submit`` returns for each admitted request, the one way to read its outputs.

The handle exists before the engine can produce anything, so no output is missed however fast the request
runs. Read it blocking (``get``/``result``) from any thread or awaiting (``aget``/``aresult``/``async for``)
from any asyncio loop. Leaving an ``async for`` before the final output aborts the request, so a cancelled
consumer never leaves work behind.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

from omni_core.engine.stream import OutputStream
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest


class RequestHandle:
    """One admitted request: ``request`` (as the engine completed it: model defaults, seed), its outputs
    (intermediate ones while streaming, the final one last, ``finished=True``) and ``abort()``."""

    def __init__(self, request: OmniDiffusionRequest, stream: OutputStream, abort: Callable[[str], None]) -> None:
        self.request = request
        self._stream = stream
        self._abort = abort

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def abort(self) -> None:
        """Abort the request (a no-op once it has ended); its final output says ``status="aborted"``."""
        self._abort(self.request_id)

    # ------------------------------------------------------------------ blocking
    def get(self, timeout: float | None = None) -> DiffusionOutput:
        """The next output; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        return self._stream.get(timeout=timeout)

    def result(self, timeout: float | None = None) -> DiffusionOutput:
        """The final output, skipping intermediate ones (``timeout`` applies to each wait)."""
        while not (out := self.get(timeout)).finished:
            pass
        return out

    # ------------------------------------------------------------------ asyncio
    async def aget(self) -> DiffusionOutput:
        """The next output, awaited on the running loop."""
        return await self._stream.aget()

    async def aresult(self) -> DiffusionOutput:
        """The final output, skipping intermediate ones."""
        while not (out := await self.aget()).finished:
            pass
        return out

    def __aiter__(self) -> AsyncIterator[DiffusionOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[DiffusionOutput]:
        finished = False
        try:
            while not finished:
                out = await self.aget()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer left early (break, cancel, aclose)
                self.abort()

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r})"

