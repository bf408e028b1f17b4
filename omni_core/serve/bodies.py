"""Reading request bodies without stalling the event loop.

A body is parsed only after its cheap bounds hold (``bytes.count`` of JSON brackets and commas, of multipart
boundaries: C speed, well under a millisecond per MiB), and then in a worker thread, so ``/health`` and every
other request keep being answered while a large upload is parsed. ``json.loads`` is C code that holds the GIL
for the whole parse, so bounding its input is what protects the loop; the thread helps the pure-Python parts
(a form's part headers, the nesting check). No web framework is imported until a body is read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omni_core.serve.errors import APIError, invalid

# ------------------------------------------------------------------------------------------ JSON bodies
#: defaults of ``omni serve --max-json-depth`` / ``--max-json-elements`` (a request is a few dozen fields; a chat
#: message a few parts): they bound what ``json.loads`` -- C code holding the GIL, so the event loop -- may be fed
MAX_JSON_DEPTH = 64
MAX_JSON_ELEMENTS = 10_000
_WS = re.compile(r"[ \t\n\r]*")


def json_too_large(limit: int) -> APIError:
    return APIError(413, f"the JSON body has more than max_json_elements={limit} arrays, objects and elements "
                         f"(counted as '[', '{{' and ','); send a smaller body, or raise the limit with omni serve "
                         f"--max-json-elements", code="json_too_large")


def json_too_deep(limit: int, field: str | None) -> APIError:
    where = f"'{field}'" if field else "the request body"
    return APIError(400, f"{where} is nested deeper than max_json_depth={limit} levels of arrays and objects; "
                         f"raise the limit with omni serve --max-json-depth", param=field, code="json_too_deep")


def parse_json(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_elements: int = MAX_JSON_ELEMENTS) -> Any:
    """The body as JSON, or a 400. A value the parser cannot take (an integer of thousands of digits,
    nesting deeper than ``max_depth``) is reported with the top-level field that holds it.

    ``max_elements`` is checked first with ``bytes.count`` (C speed; brackets and commas inside strings count too,
    which only over-counts): a body of millions of empty arrays is a 413 before ``json.loads`` spends seconds and
    hundreds of MiB on it."""
    if not raw:
        raise invalid("the request body is empty; send a JSON object", None, code="invalid_body")
    if raw.count(b"[") + raw.count(b"{") + raw.count(b",") > max_elements:
        raise json_too_large(max_elements)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8: {exc}", None, code="invalid_json") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError, as is the int digit limit
        field = _failing_field(text)
        if isinstance(exc, RecursionError):
            raise json_too_deep(max_depth, field) from None
        elif isinstance(exc, json.JSONDecodeError):
            reason = f"is not valid JSON: {exc}"
        else:
            reason = f"cannot be read: {exc}"
        where = f"'{field}'" if field else "the request body"
        raise invalid(f"{where} {reason}", field, code="invalid_json") from None
    if json_depth(value, max_depth) > max_depth:
        deep = ([k for k, v in value.items() if json_depth(v, max_depth - 1) >= max_depth]
                if isinstance(value, dict) else [])
        raise json_too_deep(max_depth, deep[0] if deep else None)
    return value


def _failing_field(text: str) -> str | None:
    """The key of the top-level object whose value fails to decode (None when it is not such a failure)."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if text[i:i + 1] != "{":
        return None
    i += 1
    try:
        while True:
            i = _WS.match(text, i).end()
            if text[i:i + 1] != '"':
                return None
            key, i = json.decoder.scanstring(text, i + 1)
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ":":
                return None
            i = _WS.match(text, i + 1).end()
            try:
                _, i = decoder.raw_decode(text, i)
            except (ValueError, RecursionError):
                return key
            i = _WS.match(text, i).end()
            if text[i:i + 1] != ",":
                return None
            i += 1
    except ValueError:  # a malformed key
        return None


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted up to ``limit + 1`` (iterative: no recursion to exhaust)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


# ------------------------------------------------------------------------------------------ forms
#: default of ``omni serve --max-form-parts``: an edit is a few images and about twenty fields
MAX_FORM_PARTS = 64


def too_many_parts(limit: int) -> APIError:
    return APIError(413, f"the form has more than max_form_parts={limit} parts (fields and files); send fewer, or "
                         f"raise the limit with omni serve --max-form-parts", code="too_many_form_parts")


def parse_form(body: bytes, content_type: str) -> dict[str, Any]:
    """Fields of a ``multipart/form-data`` body, a file part as ``bytes`` (refused by the field checks where a
    route expects text); the last part of a repeated name wins. See :func:`parse_multipart` for files."""
    fields, files = parse_multipart(body, content_type)
    return {**fields, **{name: parts[-1] for name, parts in files.items()}}


def parse_urlencoded(body: bytes, max_fields: int = MAX_FORM_PARTS) -> dict[str, str]:
    """Fields of an ``application/x-www-form-urlencoded`` body (what aiohttp and vLLM-Omni's benchmark send for a
    form without files); a repeated name is refused, naming it; more than ``max_fields`` fields is a 413."""
    from urllib.parse import parse_qsl

    if body.count(b"&") + body.count(b";") >= max_fields:
        raise too_many_parts(max_fields)
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body.strip()))
    except UnicodeDecodeError as exc:
        raise invalid(f"the form body is not valid UTF-8: {exc}", None, code="invalid_body") from None
    except ValueError as exc:
        raise invalid(f"malformed application/x-www-form-urlencoded body: {exc}", None, code="invalid_body") from None
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in fields:
            raise invalid(f"form field '{name}' is given more than once", name, code="invalid_body")
        fields[name] = value
    return fields


#: bytes searched per C call while splitting a form: one ``find`` over 32 MiB holds the GIL (so the event loop) for
#: up to 80 ms; between windows the parsing thread lets the loop run
_WINDOW = 1 << 20


def _find(body: bytes, sub: bytes, start: int, end: int | None = None) -> int:
    """``body.find(sub, start, end)``, one window at a time."""
    end = len(body) if end is None else end
    while start < end:
        stop = min(start + _WINDOW, end)
        i = body.find(sub, start, min(stop + len(sub) - 1, end))
        if i >= 0:
            return i
        start = stop
    return -1


def _count(body: bytes, sub: bytes) -> int:
    """``body.count(sub)``, one window at a time (each occurrence counted in the window it starts in)."""
    return sum(body.count(sub, start, start + _WINDOW + len(sub) - 1) for start in range(0, len(body), _WINDOW))


def _malformed(why: str) -> APIError:
    return invalid(f"malformed multipart/form-data body: {why}", None, code="invalid_body")


def parse_multipart(body: bytes, content_type: str, max_parts: int = MAX_FORM_PARTS
                    ) -> tuple[dict[str, str], dict[str, list[bytes]]]:
    """``(text fields, file parts by name)`` of a ``multipart/form-data`` body (what the ``openai`` client sends to
    ``/v1/videos`` and ``/v1/images/edits``); a name may carry several files (``image[]``).

    The body is split at its boundary with ``bytes`` methods (C speed, no line-by-line pass over a file's bytes,
    which made the standard library's MIME parser take seconds and hundreds of MiB on a body of short lines);
    only each part's few header lines go through ``email``'s header parser. The boundaries are counted first, so
    a body of more than ``max_parts`` parts is a 413 before any part is parsed.
    """
    from email.message import Message

    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise _malformed("the Content-Type has no boundary")
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    first = delimiter[2:]
    if _count(body, delimiter) + body.startswith(first) - 1 > max_parts:
        raise too_many_parts(max_parts)
    pos = 0 if body.startswith(first) else _find(body, delimiter, 0)  # after a preamble, if any
    if pos < 0:
        raise _malformed(f"no boundary '--{boundary}'")
    pos += len(first) if pos == 0 else len(delimiter)
    fields: dict[str, Any] = {}
    files: dict[str, list[bytes]] = {}
    while not body.startswith(b"--", pos):  # "--boundary--" closes the body
        end = _find(body, delimiter, pos)
        if end < 0:
            raise _malformed(f"no closing boundary '--{boundary}--'")
        line_end = body.find(b"\r\n", pos, end + 2)
        if line_end < 0 or body[pos:line_end].strip(b" \t"):
            raise _malformed("a boundary line is followed by text")
        blank = body.find(b"\r\n\r\n", line_end, end + 2)
        if blank < 0:
            raise _malformed("a part has no blank line after its headers")
        _add_part(body[line_end + 2:blank + 2], body[blank + 4:end], fields, files)  # one copy of the payload
        pos = end + len(delimiter)
    return fields, files


def _add_part(head: bytes, payload: bytes, fields: dict[str, Any], files: dict[str, list[bytes]]) -> None:
    """One part (its header block, its bytes) into ``fields`` or ``files``."""
    from email.parser import BytesHeaderParser
    from email.policy import HTTP
    from email.utils import collapse_rfc2231_value

    part = BytesHeaderParser(policy=HTTP).parsebytes(head + b"\r\n")
    name = part.get_param("name", header="content-disposition")
    if not name:
        return
    name = collapse_rfc2231_value(name)
    encoding = str(part.get("content-transfer-encoding", "")).strip().lower()
    if encoding in ("base64", "quoted-printable"):  # deprecated in forms (RFC 7578) but legal
        import binascii
        import quopri

        try:
            payload = binascii.a2b_base64(payload) if encoding == "base64" else quopri.decodestring(payload)
        except ValueError:
            raise invalid(f"form part '{name}' is not valid {encoding}", name, code="invalid_body") from None
    if part.get_filename() is not None:
        files.setdefault(name, []).append(payload)
        return
    charset = part.get_content_charset() or "utf-8"
    try:
        fields[name] = payload.decode(charset)
    except LookupError:
        raise invalid(f"form field '{name}' has an unknown charset {charset!r}; send UTF-8", name,
                      code="invalid_body") from None
    except UnicodeDecodeError as exc:
        raise invalid(f"form field '{name}' is not valid {charset}: {exc}", name, code="invalid_body") from None


# ------------------------------------------------------------------------------------------ async readers
async def read_json(request: Any, server: Any) -> Any:
    """The request's JSON body under the server's ``max_json_depth`` and ``max_json_elements``."""
    from starlette.concurrency import run_in_threadpool

    raw = await request.body()
    return await run_in_threadpool(parse_json, raw, max_depth=server.max_json_depth,
                                   max_elements=server.max_json_elements)


async def read_multipart(request: Any, server: Any, content_type: str) -> tuple[dict, dict]:
    """``(fields, files)`` of a ``multipart/form-data`` body of at most ``max_form_parts`` parts."""
    from starlette.concurrency import run_in_threadpool

    raw = await request.body()
    return await run_in_threadpool(parse_multipart, raw, content_type, server.max_form_parts)


async def read_urlencoded(request: Any, server: Any) -> dict:
    """Fields of an ``application/x-www-form-urlencoded`` body of at most ``max_form_parts`` fields."""
    from starlette.concurrency import run_in_threadpool

    raw = await request.body()
    return await run_in_threadpool(parse_urlencoded, raw, server.max_form_parts)
