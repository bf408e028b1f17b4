"""Reading request bodies without stalling the event loop.

A body is parsed only after its cheap bounds hold (``bytes.count`` of JSON brackets and commas, of multipart
boundaries: C speed, well under a millisecond per MiB), and then in a worker thread, so ``/health`` and every
other request keep being answered while a large upload is parsed. ``json.loads`` is C code that holds the GIL
for the whole parse, so bounding its input is what protects the loop; the thread helps the pure-Python parts
(a form's part headers, the nesting check).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from omni_core.serve.protocol import parse_json, parse_multipart, parse_urlencoded


async def read_json(request: Any, server: Any) -> Any:
    """The request's JSON body under the server's ``max_json_depth`` and ``max_json_elements``."""
    raw = await request.body()
    return await run_in_threadpool(parse_json, raw, max_depth=server.max_json_depth,
                                   max_elements=server.max_json_elements)


async def read_multipart(request: Any, server: Any, content_type: str) -> tuple[dict, dict]:
    """``(fields, files)`` of a ``multipart/form-data`` body of at most ``max_form_parts`` parts."""
    raw = await request.body()
    return await run_in_threadpool(parse_multipart, raw, content_type, server.max_form_parts)


async def read_urlencoded(request: Any, server: Any) -> dict:
    """Fields of an ``application/x-www-form-urlencoded`` body of at most ``max_form_parts`` fields."""
    raw = await request.body()
    return await run_in_threadpool(parse_urlencoded, raw, server.max_form_parts)
