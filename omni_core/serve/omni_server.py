"""``OmniServer``: the state the routes share -- the engine client, the served model, auth, in-flight
requests, the video jobs, the metrics -- and the server's lifecycle (housekeeping, engine watch, shutdown).

The engine is reached only through :class:`~omni_core.engine.client.EngineClient`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from typing import Any, Callable

from omni_core.engine.client import EngineClient
from omni_core.errors import ConfigError
from omni_core.serve.bodies import MAX_FORM_PARTS, MAX_JSON_DEPTH, MAX_JSON_ELEMENTS
from omni_core.serve.errors import APIError, dead_message, generation_failed
from omni_core.serve.metrics import ServerMetrics
from omni_core.serve.lora_access import check_lora_dirs
from omni_core.serve.served_model import ServedModel
from omni_core.serve.videos import VideoJobs

logger = logging.getLogger("omni_core.serve")

#: largest side of a streamed preview image (previews are cheap latent projections; keep events small)
PREVIEW_MAX_SIDE = 256
#: default cap on a request body: a request is a prompt and a few numbers, far below this
MAX_BODY_BYTES = 1 << 20
#: the body cap of the routes that take input images (edits, videos, chat messages with data URLs)
MAX_UPLOAD_BYTES = 32 << 20
#: the model name vLLM-Omni's clients send by default; it names the served model
DEFAULT_MODEL_ALIAS = "default"
#: default seconds in-flight requests get to finish at shutdown before they are aborted through the engine
SHUTDOWN_GRACE_S = 10.0
#: ``Authorization: Bearer <token>``: scheme in any case, exactly one space, a token without whitespace
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] (\S+)")


def current(request: Any) -> OmniServer:
    """The ``OmniServer`` of the app serving ``request`` (``build_app`` puts it in ``app.state.omni``)."""
    return request.app.state.omni


def served_fleet(engine_or_omni: Any) -> Any:
    """The ``ModelFleet`` behind what a server is given (directly, or an ``Omni`` over several models), or None."""
    fleet = getattr(engine_or_omni, "fleet", None) or engine_or_omni
    return fleet if callable(getattr(fleet, "members", None)) else None


def served_engines(engine_or_omni: Any, served_model_name: str | None) -> dict[str, EngineClient]:
    """Name -> engine client of every model served: a fleet's members, a mapping of clients, or one engine
    (``AsyncOmni`` / ``Omni`` hold it in ``.engine``) named ``served_model_name`` or its model."""
    fleet = served_fleet(engine_or_omni)
    if fleet is not None:
        if served_model_name is not None:
            raise ConfigError("served_model_name names the one model of a one-model server; a fleet's models are "
                              "named in its config", field="served_model_name")
        return fleet.members()
    if isinstance(engine_or_omni, dict):
        if not engine_or_omni:
            raise ConfigError("no model to serve: the mapping of engines is empty", field="models")
        return dict(engine_or_omni)
    engine = getattr(engine_or_omni, "engine", engine_or_omni)
    return {served_model_name or engine.model_info.model: engine}


class OmniServer:
    """State shared by the routes: the served models, the video jobs, the metrics."""

    def __init__(self, engine_or_omni: Any, *, served_model_name: str | None = None, api_key: str | None = None,
                 video_dir: str | None = None, max_video_jobs: int = 100, video_ttl_s: float = 3600.0,
                 retry_after_s: int = 1, close_engine: bool = False, preview_max_side: int = PREVIEW_MAX_SIDE,
                 max_body_bytes: int = MAX_BODY_BYTES, shutdown_grace_s: float = SHUTDOWN_GRACE_S,
                 exit_on_engine_death: bool = False, max_upload_bytes: int = MAX_UPLOAD_BYTES,
                 max_form_parts: int = MAX_FORM_PARTS, max_json_depth: int = MAX_JSON_DEPTH,
                 max_json_elements: int = MAX_JSON_ELEMENTS, lora_dirs: Any = ()):
        if api_key is not None and (not isinstance(api_key, str) or not api_key or _BEARER.fullmatch(
                f"Bearer {api_key}") is None):
            raise ConfigError(f"api_key={api_key!r} is invalid: give a non-empty key without whitespace, or "
                              f"api_key=None for no authentication", field="api_key")
        for name, value in (("max_body_bytes", max_body_bytes), ("max_upload_bytes", max_upload_bytes),
                            ("max_form_parts", max_form_parts), ("max_json_depth", max_json_depth),
                            ("max_json_elements", max_json_elements)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value} is invalid: must be >= 1", field=name)
        #: a fleet (``start_fleet``, or an ``Omni`` over several models) reports where its models are
        self.fleet = served_fleet(engine_or_omni)
        self.lora_dirs = check_lora_dirs([lora_dirs] if isinstance(lora_dirs, str) else lora_dirs)
        #: a request's ``lora``: a preloaded name of its model, or a file under one of these (real paths)
        self.models: dict[str, ServedModel] = {
            name: ServedModel(name, engine, self, moves=self.fleet is not None)
            for name, engine in served_engines(engine_or_omni, served_model_name).items()}
        #: the model of a request that names none (or ``"default"``): the first one
        self.default = next(iter(self.models.values()))
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes
        #: what a body may hold before it is parsed (docs/serving.md, "Request limits")
        self.max_form_parts, self.max_json_depth = max_form_parts, max_json_depth
        self.max_json_elements = max_json_elements
        self.shutdown_grace_s = shutdown_grace_s
        self.exit_on_engine_death = exit_on_engine_death
        #: set by the uvicorn wrapper (``omni_core.serve.server``): makes the server shut down gracefully
        self.stop_serving: Callable[[], None] | None = None
        #: true once the server stopped because its engine died (``omni serve`` then exits non-zero)
        self.engine_died = False
        #: engine request id -> its model, of the requests an HTTP client waits for (aborted at shutdown)
        self._inflight: dict[str, ServedModel] = {}
        self._admission_pool: Any = None
        self.retry_after_s = retry_after_s
        self.close_engine = close_engine
        self.preview_max_side = preview_max_side
        self.metrics = ServerMetrics()
        self.videos = VideoJobs(video_dir, max_jobs=max_video_jobs, ttl_s=video_ttl_s)
        self.created = int(time.time())
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        if self.exit_on_engine_death:
            self._tasks.append(asyncio.create_task(self._watch_engine()))

    async def _watch_engine(self) -> None:
        """Stop serving once the engine is dead: its in-flight requests were failed (answered 503) and every
        later one would be too, so exiting lets a supervisor start a healthy server."""
        engine = self.default.engine
        while not engine.is_dead:
            await asyncio.sleep(0.2)
        logger.error("%s; answering in-flight requests, then exiting", dead_message(engine.dead_reason))
        self.engine_died = True
        if self.stop_serving is not None:
            self.stop_serving()

    def begin_shutdown(self) -> None:
        """Shutdown started (uvicorn stopped listening): requests still running after the grace period are
        aborted through the engine, so their clients get the documented error rather than a cut connection."""

        async def abort_after_grace() -> None:
            await asyncio.sleep(self.shutdown_grace_s)
            if self._inflight:
                logger.warning("aborting %d request(s) still running %g s after shutdown began",
                               len(self._inflight), self.shutdown_grace_s)
                for model in set(self._inflight.values()):
                    model.engine.abort(sorted(r for r, m in self._inflight.items() if m is model))

        self._tasks.append(asyncio.create_task(abort_after_grace()))

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.videos.close()
        if self.close_engine:
            closing = self.fleet if self.fleet is not None else self.default.engine
            await asyncio.get_running_loop().run_in_executor(None, closing.close)
        if self._admission_pool is not None:
            self._admission_pool.shutdown(wait=False, cancel_futures=True)

    async def _housekeeping(self) -> None:
        """Once a second: sample the step counter (steps/s) and expire old video jobs."""
        while True:
            for name, model in self.models.items():
                self.metrics.sample_steps(model.engine.stats()["denoise_steps"], model=name)
            self.videos.sweep()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ checks
    def check_auth(self, authorizations: list[str]) -> None:
        """Exactly one ``Authorization: Bearer <key>`` header carrying the key, or a 401."""
        if self.api_key is None:
            return
        match = _BEARER.fullmatch(authorizations[0]) if len(authorizations) == 1 else None
        if match is None or not hmac.compare_digest(match.group(1).encode(), self.api_key.encode()):
            self.metrics.count_refused("unauthorized")
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def model(self, name: Any) -> ServedModel:
        """The served model a request names: by name, or the default one for none or ``"default"`` (what
        vLLM-Omni's clients send when not told a name); any other name is a 404 naming the served models."""
        if name is None or name == DEFAULT_MODEL_ALIAS:
            return self.default
        found = self.models.get(name) if isinstance(name, str) else None
        if found is None:
            served = ", ".join(repr(n) for n in self.models)
            raise APIError(404, f"the model {name!r} does not exist on this server; it serves {served}",
                           param="model", code="model_not_found")
        return found

    def model_of(self, body: Any) -> ServedModel:
        """The model a body (JSON or form fields) names; a ``model`` that is not a string is left to the body's
        own parser to refuse (400), with the default model's fields."""
        name = body.get("model") if isinstance(body, dict) else None
        return self.model(name) if name is None or isinstance(name, str) else self.default

    def admission_pool(self) -> Any:
        """Threads that admit requests to a fleet's models (a load or a wait for room blocks one, not the loop)."""
        if self._admission_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._admission_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="omni-admit")
        return self._admission_pool

    def track(self, request_id: str, model: ServedModel) -> None:
        self._inflight[request_id] = model

    def untrack(self, request_id: str) -> None:
        self._inflight.pop(request_id, None)

    async def run_to_end(self, request: Any, handle: Any, model: ServedModel, kind: str = "image") -> Any:
        """The completed output of a tracked request (None if the client left; a failure raises its APIError)."""
        try:
            out = await self.final_output(request, handle)
        finally:
            self.untrack(handle.request_id)
        if out is None:
            return None
        if out.status != "completed":
            raise generation_failed(out, model.engine.is_dead, model.failure_prefix())
        self.metrics.observe_generation(kind, out.metrics, model=model.name)
        return out

    async def final_output(self, request: Any, handle: Any) -> Any:
        """The request's final output, or None if the client disconnected first (the request is aborted)."""

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = asyncio.ensure_future(handle.aresult())
        watch = asyncio.ensure_future(disconnected())
        finished = False
        try:
            await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
            if result.done():
                finished = True
                return result.result()
            self.metrics.count_disconnect()
            return None
        finally:
            result.cancel()
            watch.cancel()
            if not finished:
                handle.abort()
