"""The OpenAI-compatible HTTP app: ``build_app(engine)`` -> a FastAPI app running requests on that engine.

The engine runs in the server process; each HTTP request becomes one engine request whose output stream is
bound to the server's event loop. A client that goes away aborts its request (non-streamed: a task watches
for ``http.disconnect`` while the result is awaited; streamed: the response stops on disconnect), so the
engine never keeps work nobody will read. A full engine queue answers 429 with ``Retry-After``.

When the engine runs with ``streaming_output=True`` (``omni serve`` does, if the pipeline can run step by
step) every request runs step-wise and yields a preview per step; a non-streamed request just skips them,
so its image is the same as the streamed one (the tests check this bit for bit, also against an engine
without streaming).

This module imports FastAPI; ``omni_core.serve`` loads it only when ``build_app`` is first used.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import io
import logging
import re
import time
import warnings
from typing import Any, Callable

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from omni_core.errors import ConfigError, EngineDeadError, OmniError
from omni_core.request import OmniDiffusionRequest
from omni_core.serve.metrics import ServerMetrics
from omni_core.serve.protocol import (APIError, ImageRequest, config_error, image_body_schema, invalid, parse_form,
                                      parse_image_request, parse_json, parse_video_request, too_large,
                                      video_body_schema)
from omni_core.serve.videos import CANCELLED, COMPLETED, FAILED, IN_PROGRESS, VideoJob, VideoJobs

logger = logging.getLogger("omni_core.serve")

#: largest side of a streamed preview image (previews are cheap latent projections; keep events small)
PREVIEW_MAX_SIDE = 256
#: default cap on a request body: a request is a prompt and a few numbers, far below this
MAX_BODY_BYTES = 1 << 20
#: default seconds in-flight requests get to finish at shutdown before they are aborted through the engine
SHUTDOWN_GRACE_S = 10.0
#: routes that need no API key (probes and scrapers)
OPEN_PATHS = ("/health", "/metrics")
#: ``Authorization: Bearer <token>``: scheme in any case, exactly one space, a token without whitespace
_BEARER = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] (\S+)")
_DEAD_PREFIX = "the engine is dead: "


def dead_message(reason: str | None) -> str:
    """``the engine is dead: <reason>``, said once (executors already prefix their reasons with it)."""
    reason = reason or "a worker died"
    while reason.startswith(_DEAD_PREFIX):
        reason = reason[len(_DEAD_PREFIX):]
    return _DEAD_PREFIX + reason


def _png_b64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _preview_image(tensor: Any, max_side: int) -> Any:
    from omni_core.pipelines.base import tensor_to_pil

    image = tensor_to_pil(tensor)
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side))
    return image


def _pil_outputs(out: Any) -> list:
    """The output's images as PIL (a list of frames per video). The server asks the engine for tensors
    (``output_type="pt"``) and converts them itself, so a client gets the model's pixels at the ``size`` it
    asked for (a plugin's display tweaks for PIL output, such as upscaling, do not apply)."""
    from omni_core.pipelines.base import tensor_to_pil

    return [im if not hasattr(im, "dim") else tensor_to_pil(im) for im in (out.images or [])]


def _size_of(image: Any) -> str:
    if isinstance(image, list):  # video frames
        image = image[0]
    return f"{image.width}x{image.height}"


class OmniServer:
    """State shared by the routes: the engine, the video jobs, the metrics."""

    def __init__(self, engine_or_omni: Any, *, served_model_name: str | None = None, api_key: str | None = None,
                 video_dir: str | None = None, max_video_jobs: int = 100, video_ttl_s: float = 3600.0,
                 retry_after_s: int = 1, close_engine: bool = False, preview_max_side: int = PREVIEW_MAX_SIDE,
                 max_body_bytes: int = MAX_BODY_BYTES, shutdown_grace_s: float = SHUTDOWN_GRACE_S,
                 exit_on_engine_death: bool = False):
        if api_key is not None and (not isinstance(api_key, str) or not api_key or _BEARER.fullmatch(
                f"Bearer {api_key}") is None):
            raise ConfigError(f"api_key={api_key!r} is invalid: give a non-empty key without whitespace, or "
                              f"api_key=None for no authentication", field="api_key")
        if max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes={max_body_bytes} is invalid: must be >= 1", field="max_body_bytes")
        self.engine = getattr(engine_or_omni, "engine", engine_or_omni)  # AsyncOmni / Omni or the engine itself
        self.model_name = served_model_name or self.engine.config.model
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.shutdown_grace_s = shutdown_grace_s
        self.exit_on_engine_death = exit_on_engine_death
        #: set by the uvicorn wrapper (``omni_core.serve.server``): makes the server shut down gracefully
        self.stop_serving: Callable[[], None] | None = None
        #: true once the server stopped because its engine died (``omni serve`` then exits non-zero)
        self.engine_died = False
        self._inflight: set[str] = set()  # engine request ids of image requests an HTTP client waits for
        self.retry_after_s = retry_after_s
        self.close_engine = close_engine
        self.preview_max_side = preview_max_side
        self.is_video = bool(getattr(self.engine.pipeline_cls, "is_video", False))
        self.streaming = bool(self.engine.config.streaming_output)
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
        while not self.engine.is_dead:
            await asyncio.sleep(0.2)
        logger.error("%s; answering in-flight requests, then exiting", dead_message(self.engine.stats()["dead"]))
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
                self.engine.abort(sorted(self._inflight))

        self._tasks.append(asyncio.create_task(abort_after_grace()))

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.videos.close()
        if self.close_engine:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    async def _housekeeping(self) -> None:
        """Once a second: sample the step counter (steps/s) and expire old video jobs."""
        while True:
            self.metrics.sample_steps(self.engine.counters["denoise_steps"])
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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist on this server; it serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ engine
    def submit(self, prompt: str, negative_prompt: str | None, params: Any):
        """Validate and queue one request; returns ``(request, stream)`` or raises the matching APIError.

        The stream is taken at admission (``engine.submit``) rather than looked up later, so a request that
        ends before its reader starts still delivers its final output.
        """
        from omni_core.engine.engine import QueueFullError

        params = params.replace(output_type="pt")  # see _pil_outputs
        request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative_prompt, sampling_params=params)
        try:
            stream = self.engine.submit(request, bind_loop=True)
        except ConfigError as exc:
            raise config_error(exc) from None
        except QueueFullError as exc:
            self.metrics.count_refused("queue_full")
            raise APIError(429, str(exc), code="queue_full", type="rate_limit_error",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except EngineDeadError as exc:
            raise engine_dead(str(exc)) from None
        except OmniError as exc:
            raise APIError(503, str(exc), code="engine_unavailable", type="server_error") from None
        return request, stream

    def track(self, request_id: str) -> None:
        self._inflight.add(request_id)

    def untrack(self, request_id: str) -> None:
        self._inflight.discard(request_id)

    async def final_output(self, request: Any, stream: Any, request_id: str) -> Any:
        """The request's final output, or None if the client disconnected first (the request is aborted)."""

        async def drain():
            while True:
                out = await stream.aget()
                if out.finished:
                    return out

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = asyncio.ensure_future(drain())
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
                self.engine.abort(request_id)

    # ------------------------------------------------------------------ images
    def image_payload(self, out: Any) -> dict[str, Any]:
        images = _pil_outputs(out)
        return {"created": int(time.time()), "data": [{"b64_json": _png_b64(im), "revised_prompt": None}
                                                      for im in images],
                "output_format": "png", "size": _size_of(images[0]) if images else None,
                "seed": out.metrics.get("seed")}

    def generation_failed(self, out: Any) -> APIError:
        if out.status == "error" and self.engine.is_dead:
            return engine_dead(out.error)
        if out.status == "aborted":
            return APIError(503, f"the request was aborted: {out.error or 'the server is shutting down'}",
                            code="request_aborted", type="server_error")
        return APIError(500, f"generation failed: {out.error}", code="generation_failed", type="server_error")

    async def image_events(self, req: ImageRequest, stream: Any, request_id: str, state: dict):
        """Server-sent events: one partial image per intermediate output (the engine yields one after each
        denoising step), then one completed event per image.

        A failure while streaming ends the stream with an ``error`` event (what the ``openai`` client raises)."""
        try:
            async for event in self._image_events(req, stream, state):
                yield event
        except Exception as exc:  # noqa: BLE001 - e.g. an image that cannot be encoded
            logger.exception("streaming request %s failed", request_id)
            state["server_error"] = True
            yield _sse("error", APIError(500, f"streaming failed: {type(exc).__name__}: {exc}", type="server_error",
                                         code="internal_error").body())

    async def _image_events(self, req: ImageRequest, stream: Any, state: dict):
        index = 0
        common = {"quality": "auto", "background": "opaque", "output_format": "png"}
        size = f"{req.params.width}x{req.params.height}"
        while True:
            out = await stream.aget()
            if not out.finished:
                if out.preview is None:
                    continue
                image = _preview_image(out.preview, self.preview_max_side)
                yield _sse("image_generation.partial_image", {
                    "type": "image_generation.partial_image", "b64_json": _png_b64(image),
                    "partial_image_index": index, "step": out.step_index, "num_steps": out.num_steps,
                    "created_at": int(time.time()), "size": size, **common})
                index += 1
                continue
            state["finished"] = True
            if out.status != "completed":
                err = self.generation_failed(out)
                yield _sse("error", err.body())
                return
            self.metrics.observe_generation("image", out.metrics)
            images = await asyncio.to_thread(_pil_outputs, out)
            encoded = await asyncio.to_thread(lambda: [_png_b64(im) for im in images])
            for k, b64 in enumerate(encoded):
                yield _sse("image_generation.completed", {
                    "type": "image_generation.completed", "b64_json": b64, "index": k,
                    "seed": out.metrics.get("seed"), "created_at": int(time.time()),
                    "size": _size_of(images[k]), **common,
                    "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                              "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}})
            return

    # ------------------------------------------------------------------ videos
    async def run_video_job(self, job: VideoJob, stream: Any) -> None:
        """Follow the job's request to its end and write the MP4 (the task is cancelled on delete)."""
        from omni_core.utils.media import write_video

        finished = False
        try:
            out = None
            while out is None or not out.finished:
                out = await stream.aget()
            finished = True
            if out.status != "completed":
                status = CANCELLED if out.status == "aborted" else FAILED
                job.finish(status, self.videos.ttl_s, None if status == CANCELLED else
                           {"code": "generation_failed", "message": str(out.error)})
                return
            self.metrics.observe_generation("video", out.metrics)
            job.seed = out.metrics.get("seed")
            (frames,) = await asyncio.to_thread(_pil_outputs, out)
            if not isinstance(frames, list):  # an image model's output: one frame
                frames = [frames]
            path = self.videos.path_for(job.id)
            write = asyncio.get_running_loop().run_in_executor(None, write_video, frames, path, job.fps)
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:  # deleted while writing: remove the file once it is written
                write.add_done_callback(lambda _: _remove(path))
                raise
            job.path = path
            if job.id not in self.videos:  # deleted meanwhile
                _remove(path)
            job.finish(COMPLETED, self.videos.ttl_s)
        except asyncio.CancelledError:
            if not finished:
                self.engine.abort(job.request_id)
            job.status = CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the MP4 writer is missing; the job fails, not the server
            logger.exception("video job %s failed", job.id)
            job.finish(FAILED, self.videos.ttl_s, {"code": "encoding_failed", "message": f"{type(exc).__name__}: {exc}"})

    def on_video_progress(self, job: VideoJob):
        def update(request_id: str, step: int, total: int) -> None:  # engine thread
            if not job.finished:
                job.status = IN_PROGRESS
                job.progress = min(99, int(100 * step / max(total, 1)))
        return update


def engine_dead(reason: str | None) -> APIError:
    return APIError(503, dead_message(reason), code="engine_dead", type="engine_dead")


def _remove(path: str) -> None:
    import os

    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _sse(event: str, data: dict[str, Any]) -> str:
    import json

    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def build_app(engine_or_omni: Any, *, served_model_name: str | None = None, api_key: str | None = None,
              video_dir: str | None = None, max_video_jobs: int = 100, video_ttl_s: float = 3600.0,
              retry_after_s: int = 1, close_engine: bool = False, preview_max_side: int = PREVIEW_MAX_SIDE,
              max_body_bytes: int = MAX_BODY_BYTES, shutdown_grace_s: float = SHUTDOWN_GRACE_S,
              exit_on_engine_death: bool = False) -> Any:
    """A FastAPI app serving ``engine_or_omni`` (a ``DiffusionEngine``, ``AsyncOmni`` or ``Omni``).

    ``served_model_name``: the ``model`` clients name (default: the engine's ``model``). ``api_key``: when
    set, every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <key>`` (checked before
    routing, so unknown routes are 401 too); an empty key is refused. ``video_dir``: where MP4s go (default: a
    temp dir removed at shutdown). ``close_engine``: close the engine when the app shuts down (``omni serve``
    owns its engine; tests usually own theirs). ``max_body_bytes``: larger bodies get 413 (counted while
    read). ``shutdown_grace_s``: at shutdown, requests still running after this long are aborted through the
    engine and answered with an error. ``exit_on_engine_death``: stop serving once the engine is dead.
    """
    server = OmniServer(engine_or_omni, served_model_name=served_model_name, api_key=api_key, video_dir=video_dir,
                        max_video_jobs=max_video_jobs, video_ttl_s=video_ttl_s, retry_after_s=retry_after_s,
                        close_engine=close_engine, preview_max_side=preview_max_side, max_body_bytes=max_body_bytes,
                        shutdown_grace_s=shutdown_grace_s, exit_on_engine_death=exit_on_engine_death)
    engine = server.engine

    class EventStream(StreamingResponse):
        """SSE that always stops on client disconnect (whatever the ASGI spec version) and then runs
        ``on_close`` -- also when the body never started, so no admitted request is left behind."""

        media_type = "text/event-stream"

        def __init__(self, content: Any, on_close: Any) -> None:
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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.startup()
        try:
            yield
        finally:
            await server.shutdown()

    app = FastAPI(title="Omni", description="OpenAI-compatible image and video generation", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.omni = server

    # ---------------------------------------------------------------- errors in OpenAI's shape
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

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                                     code="internal_error").body(), status_code=500)

    # ---------------------------------------------------------------- open routes
    @app.api_route("/health", methods=["GET", "HEAD"], responses={
        200: {"description": "the engine is alive"}, 503: _error_doc("the engine is dead")})
    async def health():
        stats = engine.stats()
        if stats["dead"]:
            return JSONResponse({"status": "dead", "reason": dead_message(stats["dead"])}, status_code=503)
        return {"status": "ok", "model": server.model_name, "waiting": stats["waiting"], "running": stats["running"]}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        text = server.metrics.render(engine.stats(), model=server.model_name, video_jobs=server.videos.counts())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---------------------------------------------------------------- /v1 (the API key is checked before routing)
    v1 = APIRouter(prefix="/v1", responses={401: _error_doc("missing or incorrect API key")})

    @v1.get("/models")
    async def models():
        spec = engine.resolved.spec
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "omni",
            "pipeline": spec.name, "modality": "video" if server.is_video else "image",
            "streaming_previews": server.streaming}]}

    @v1.post("/images/generations", responses={
        200: {"description": "the images (JSON), or with stream=true Server-Sent Events",
              "content": {"application/json": {"schema": {"type": "object"}},
                          "text/event-stream": {"schema": {"type": "string"}}}},
        **_error_docs(400, 404, 413, 429, 500, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": image_body_schema()}}}})
    async def generate_images(request: Request):
        req = parse_image_request(await _json_body(request))
        server.check_model(req.model)
        if server.is_video:
            raise invalid(f"model {server.model_name!r} makes videos; use POST /v1/videos", "model",
                          code="unsupported_model")
        if req.stream and not server.streaming:
            raise invalid("stream=true needs a server that runs its engine with streaming output (omni serve does "
                          "unless started with --no-stream-previews; the pipeline must support step execution)",
                          "stream", code="unsupported_value")
        omni_req, stream = server.submit(req.prompt, req.negative_prompt, req.params)
        rid = omni_req.request_id
        server.track(rid)
        if req.stream:
            state = {"finished": False}
            # the request as the engine completed it (model defaults such as the size filled in)
            req = ImageRequest(prompt=req.prompt, negative_prompt=req.negative_prompt,
                               params=omni_req.sampling_params, model=req.model, stream=True)

            def on_close() -> None:
                server.untrack(rid)
                if not state["finished"]:  # the client left (or the stream failed) before the end
                    if not state.get("server_error"):
                        server.metrics.count_disconnect()
                    engine.abort(rid)

            return EventStream(server.image_events(req, stream, rid, state), on_close)
        try:
            out = await server.final_output(request, stream, rid)
        finally:
            server.untrack(rid)
        if out is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        if out.status != "completed":
            raise server.generation_failed(out)
        server.metrics.observe_generation("image", out.metrics)
        return JSONResponse(await asyncio.to_thread(server.image_payload, out))

    @v1.post("/videos", responses={200: {"description": "the video job"}, **_error_docs(400, 404, 413, 429, 503)},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": video_body_schema()},
                 "multipart/form-data": {"schema": _form_schema(video_body_schema())}}}})
    async def create_video(request: Request):
        content_type = request.headers.get("content-type", "")
        frame_multiple = getattr(engine.pipeline_cls, "frame_multiple", 1)
        if content_type.startswith("multipart/form-data"):
            body = parse_form(await request.body(), content_type)
            req = parse_video_request(body, frame_multiple=frame_multiple, from_form=True)
        else:
            req = parse_video_request(await _json_body(request), frame_multiple=frame_multiple)
        server.check_model(req.model)
        if not server.is_video:
            raise invalid(f"model {server.model_name!r} makes images, not videos; use POST /v1/images/generations",
                          "model", code="unsupported_model")
        server.videos.sweep()
        omni_req, stream = server.submit(req.prompt, req.negative_prompt, req.params)
        params = omni_req.sampling_params
        job = VideoJob(id=server.videos.new_id(), model=server.model_name, prompt=req.prompt,
                       size=f"{params.width}x{params.height}",
                       seconds=req.seconds or f"{params.num_frames / req.fps:g}", num_frames=params.num_frames,
                       fps=req.fps, request_id=omni_req.request_id, seed=params.seed)
        try:
            server.videos.add(job)
        except APIError:
            engine.abort(omni_req.request_id)
            raise
        engine.add_progress_listener(omni_req.request_id, server.on_video_progress(job))
        job.task = asyncio.create_task(server.run_video_job(job, stream))
        return job.to_dict()

    @v1.get("/videos")
    async def list_videos():
        jobs = server.videos.list()
        return {"object": "list", "data": [j.to_dict() for j in jobs],
                "first_id": jobs[0].id if jobs else None, "last_id": jobs[-1].id if jobs else None,
                "has_more": False}

    @v1.get("/videos/{video_id}", responses=_error_docs(404))
    async def get_video(video_id: str):
        return server.videos.get(video_id).to_dict()

    @v1.get("/videos/{video_id}/content", response_class=FileResponse, responses={
        200: {"description": "the MP4", "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
        **_error_docs(400, 404, 409)})
    async def get_video_content(video_id: str, variant: str = "video"):
        job = server.videos.get(video_id)
        if variant != "video":
            raise invalid(f"variant={variant!r} is not supported; only 'video'", "variant",
                          code="unsupported_value")
        if job.status != COMPLETED or job.path is None:
            raise APIError(409, f"video {video_id} is {job.status}; its content is available once completed",
                           param="video_id", code="video_not_ready")
        return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")

    @v1.delete("/videos/{video_id}", responses=_error_docs(404))
    async def delete_video(video_id: str):
        job = server.videos.remove(video_id)  # cancels a running job: its engine request is aborted
        if job.task is not None:
            await asyncio.gather(job.task, return_exceptions=True)
        return {"id": job.id, "object": "video.deleted", "deleted": True, "status": job.status}

    app.include_router(v1)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, made true: no 422 (validation errors are answered 400), bearer auth declared."""
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # GET and HEAD /health share a function: ids are made unique below
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                     routes=app.routes)
            for path, item in schema["paths"].items():
                for method, operation in item.items():
                    if method == "head":
                        operation["operationId"] = operation.get("operationId", path) + "_head"
                    responses = operation.setdefault("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", _error_doc("a parameter is invalid"))
                    if server.api_key is not None and path not in OPEN_PATHS:
                        operation["security"] = [{"bearer": []}]
                        responses.setdefault("401", _error_doc("missing or incorrect API key"))
            components = schema.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            components.setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
            if server.api_key is not None:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    # outermost first: metrics (counts every answer), the API key (before routing), the body cap
    app.add_middleware(_BodyLimitMiddleware, limit=server.max_body_bytes)
    app.add_middleware(_AuthMiddleware, server=server)
    app.add_middleware(_MetricsMiddleware, metrics=server.metrics)
    return app


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_STATUS_DOC = {400: "invalid request: `param` names the field", 401: "missing or incorrect API key",
               404: "unknown model, video or route", 409: "the video is not ready",
               413: "the request body is larger than --max-body-bytes",
               429: "the queue (or the video table) is full; see Retry-After",
               500: "the generation failed", 503: "the engine is dead, closed, or the server is shutting down"}


def _error_doc(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}


def _error_docs(*statuses: int) -> dict[int, Any]:
    return {status: _error_doc(_STATUS_DOC[status]) for status in statuses}


def _form_schema(json_schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON body schema as multipart form fields (every form value is text)."""
    return {"type": "object", "required": json_schema["required"],
            "properties": {name: {"type": "string"} for name in json_schema["properties"]}}


async def _json_body(request: Any) -> Any:
    return parse_json(await request.body())


async def _send_error(err: APIError, scope, receive, send) -> None:
    await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)


class _AuthMiddleware:
    """The API key is checked before routing: without it every route but the open ones is 401, so routes
    cannot be enumerated (a 404 would tell which exist)."""

    def __init__(self, app: Any, server: OmniServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.server.api_key is not None and scope["path"] not in OPEN_PATHS:
            try:
                self.server.check_auth(Headers(scope=scope).getlist("authorization"))
            except APIError as err:
                await _send_error(err, scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """Bodies over ``limit`` bytes get 413: at once when ``Content-Length`` says so, otherwise as soon as the
    bytes read pass the limit (a chunked body is never buffered beyond it)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(too_large(self.limit), scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large(self.limit)
            return message

        await self.app(scope, limited_receive, send)


class _MetricsMiddleware:
    """Pure ASGI middleware: counts requests by method, route template and status, and times them."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
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
            route = scope.get("route")
            path = getattr(route, "path", None) or "other"
            self.metrics.observe_http(scope["method"], path, status[0], time.perf_counter() - start)
