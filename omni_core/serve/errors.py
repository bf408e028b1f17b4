"""Every error the server answers, mapped in one place: :class:`APIError` (OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the offending request field), what engine
refusals and failed outputs become, and the app's exception handlers that render those, FastAPI's validation and
routing errors, and anything unexpected the same way."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from omni_core.errors import ConfigError, EngineDeadError, OmniError, QueueFullError

logger = logging.getLogger("omni_core.serve")


class APIError(Exception):
    """An HTTP error answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def too_large(limit: int, upload: bool = False) -> APIError:
    name = "max_upload_bytes" if upload else "max_body_bytes"
    return APIError(413, f"the request body is larger than {name}={limit} bytes; send a smaller body, or "
                         f"raise the limit with omni serve --{name.replace('_', '-')}", code="request_too_large")



#: SamplingParams / pipeline field -> the request field a client sends
_PARAM_OF_FIELD = {"num_outputs_per_prompt": "n", "height": "size", "width": "size", "extra_args": "extra_args",
                   "multi_modal_data.image": "image"}


def config_error(exc: ConfigError, extra: Mapping[str, str] | None = None) -> APIError:
    """A validation error of omni's config/pipeline as a 400 naming the request field the client sent, in the
    message too: a bad ``size`` is reported as ``'size'``, not as ``SamplingParams.height``."""
    field = exc.field
    param = {**_PARAM_OF_FIELD, **(extra or {})}.get(field, field) if field else None
    message = str(exc)
    if field:
        message = message.replace(f"SamplingParams.{field}=", f"{field}=")
    if param and param != field:
        hint = " (WIDTHxHEIGHT)" if param == "size" else ""
        message = f"'{param}'{hint}: {message}"
    return invalid(message, param)


_DEAD_PREFIX = "the engine is dead: "
#: the status a request is counted with when its client left before it was answered (nginx's convention)
CLIENT_CLOSED = 499


def dead_message(reason: str | None) -> str:
    """``the engine is dead: <reason>``, said once (executors already prefix their reasons with it)."""
    reason = reason or "a worker died"
    while reason.startswith(_DEAD_PREFIX):
        reason = reason[len(_DEAD_PREFIX):]
    return _DEAD_PREFIX + reason


def engine_dead(reason: str | None, prefix: str = "") -> APIError:
    return APIError(503, prefix + dead_message(reason), code="engine_dead", type="engine_dead")


def admission_error(exc: OmniError, retry_after_s: int) -> APIError:
    """Why the engine refused a request: 400 (a field, named), 429 (queue full), 503 (dead or closed)."""
    if isinstance(exc, ConfigError):
        return config_error(exc)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full", type="rate_limit_error",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return engine_dead(str(exc))
    return APIError(503, str(exc), code="engine_unavailable", type="server_error")


def generation_failed(out: Any, engine_is_dead: bool, prefix: str = "") -> APIError:
    """A final output that did not complete: the engine died (503), it timed out (504), it was aborted (503), it ran
    out of memory (500, ``out_of_memory``), or it failed (500). ``prefix`` names the model on a server of several."""
    if out.status == "error" and engine_is_dead:
        return engine_dead(out.error, prefix)
    if out.metrics.get("timed_out"):  # its deadline passed (the 'timeout' field, X-Request-Timeout)
        return APIError(504, str(out.error), code="request_timeout", type="timeout_error")
    if out.status == "aborted":
        return APIError(503, f"the request was aborted: {out.error or 'the server is shutting down'}",
                        code="request_aborted", type="server_error")
    if out.metrics.get("out_of_memory"):  # a smaller request (size, frames, batch) may fit: said by its own code
        return APIError(500, f"{prefix}generation failed: out of memory: {out.error}", code="out_of_memory",
                        type="server_error")
    return APIError(500, f"{prefix}generation failed: {out.error}", code="generation_failed", type="server_error")


def internal_error(exc: BaseException, what: str) -> APIError:
    return APIError(500, f"{what}: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")


def install_error_handlers(app: Any) -> None:
    """Answer every error in OpenAI's shape: APIError as is, validation errors as 400 (never 422), routing
    errors with their status, anything else as a logged 500."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        param = str(errors[0]["loc"][-1]) if errors and errors[0].get("loc") else None
        return JSONResponse(invalid(str(errors[0].get("msg") if errors else exc), param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=code).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect):
        # the client closed the connection while sending its body: its fault, not ours (no traceback); 499 is
        # nginx's "client closed request", what the metrics count it as (nobody reads this answer)
        logger.info("client closed the connection during %s %s before its body was read", request.method,
                    request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(internal_error(exc, "internal error").body(), status_code=500)


async def send_error(err: APIError, scope, receive, send) -> None:
    """Answer ``err`` from ASGI middleware (before routing, where the handlers above do not apply)."""
    from fastapi.responses import JSONResponse

    await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
