"""Pure ASGI middleware, outermost first: metrics (counts every answer), the API key (before routing),
the body cap."""

from __future__ import annotations

import time
from typing import Any

from starlette.datastructures import Headers

from omni_core.serve.errors import send_error
from omni_core.serve.openapi import OPEN_PATHS
from omni_core.serve.errors import APIError, too_large
from omni_core.serve.routes.playground import PAGE_PATHS


#: set in the ASGI scope of a request refused by the API key check
UNAUTHENTICATED = "omni.unauthenticated"
#: the HTTP methods counted by name; any other is counted as "other" (a client chooses the method)
KNOWN_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def metric_labels(scope: dict) -> tuple[str, str]:
    """``(method, path)`` labels from fixed sets, so no client can add series: a known method or "other"; the
    matched route's template, "unauthenticated" (refused by the key check, before routing), or "other"."""
    method = scope.get("method", "")
    if scope.get(UNAUTHENTICATED):
        path = "unauthenticated"
    else:
        path = getattr(scope.get("route"), "path", None) or "other"
    return (method if method in KNOWN_METHODS else "other"), path


class AuthMiddleware:
    """The API key is checked before routing: without it every route but the open ones is 401, so routes
    cannot be enumerated (a 404 would tell which exist). The playground page (``PAGE_PATHS``) is public too: it
    holds no data, and the API calls it makes carry the key its user types."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.server.api_key is not None and scope["path"] not in OPEN_PATHS \
                and scope["path"] not in PAGE_PATHS:
            try:
                self.server.check_auth(Headers(scope=scope).getlist("authorization"))
            except APIError as err:
                scope[UNAUTHENTICATED] = True  # counted under a fixed path label: nothing of the request is kept
                await send_error(err, scope, receive, send)
                return
        await self.app(scope, receive, send)


#: routes whose bodies carry input images: capped by ``upload_limit`` instead of ``limit``
UPLOAD_PATHS = frozenset({"/v1/images/edits", "/v1/videos", "/v1/chat/completions"})


class BodyLimitMiddleware:
    """Bodies over the limit get 413: at once when ``Content-Length`` says so, otherwise as soon as the bytes
    read pass it (a chunked body is never buffered beyond it). Routes that take images (``UPLOAD_PATHS``) have
    the larger ``upload_limit``."""

    def __init__(self, app: Any, limit: int, upload_limit: int | None = None) -> None:
        self.app, self.limit = app, limit
        self.upload_limit = upload_limit or limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["path"] in UPLOAD_PATHS
        limit = self.upload_limit if upload else self.limit
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(too_large(limit, upload), scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit, upload)
            return message

        await self.app(scope, limited_receive, send)


class MetricsMiddleware:
    """Counts requests by method, route template and status (labels from :func:`metric_labels`), and times them.
    A client that left mid-body is status 499 (see ``errors.install_error_handlers``)."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            method, path = metric_labels(scope)
            self.metrics.observe_http(method, path, status[0], time.perf_counter() - start)
