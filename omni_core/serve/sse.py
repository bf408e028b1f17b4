"""Server-sent events: the wire encoding, and a streaming response that never outlives its client."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable

import anyio
from fastapi.responses import StreamingResponse


def sse(event: str, data: dict[str, Any]) -> str:
    """One event: ``event: <name>`` and compact JSON ``data``."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """SSE that always stops on client disconnect (whatever the ASGI spec version) and then runs
    ``on_close`` -- also when the body never started, so no admitted request is left behind."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
