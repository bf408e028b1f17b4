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

from omni_core.engine.client import EngineClient, ProgressFn
from omni_core.errors import ConfigError, OmniError, QueueFullError
from omni_core.request import OmniDiffusionRequest
from omni_core.serve.bodies import MAX_FORM_PARTS, MAX_JSON_DEPTH, MAX_JSON_ELEMENTS
from omni_core.serve.errors import APIError, admission_error, dead_message, generation_failed
from omni_core.serve.metrics import ServerMetrics
from omni_core.serve.lora_access import allowed_lora, check_lora_dirs
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


class OmniServer:
    """State shared by the routes: the engine client, the video jobs, the metrics."""

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
        #: AsyncOmni / Omni hold their engine client in ``.engine``; or this is the client itself
        self.engine: EngineClient = getattr(engine_or_omni, "engine", engine_or_omni)
        self.model_info = self.engine.model_info
        self.model_name = served_model_name or self.model_info.model
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes
        #: what a body may hold before it is parsed (docs/serving.md, "Request limits")
        self.max_form_parts, self.max_json_depth = max_form_parts, max_json_depth
        self.max_json_elements = max_json_elements
        #: a request's ``lora``: a preloaded name, or a file under one of these (real paths)
        self.lora_dirs = check_lora_dirs([lora_dirs] if isinstance(lora_dirs, str) else lora_dirs)
        self.lora_names = dict(getattr(getattr(self.engine, "config", None), "loras", None) or {})
        #: the input images the served model takes (None: none) and the per-image pixel limit
        self.image_input = self.model_info.image_input
        self.max_image_pixels = self.engine.limits.max_image_pixels
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
        self.is_video = self.model_info.is_video
        self.streaming = self.model_info.streaming
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
        logger.error("%s; answering in-flight requests, then exiting", dead_message(self.engine.dead_reason))
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
            self.metrics.sample_steps(self.engine.stats()["denoise_steps"])
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
        """A request names the served model, or none, or ``"default"`` (what vLLM-Omni's clients send when
        they are not told a name: one server serves one model, so it is that one)."""
        if model is not None and model not in (self.model_name, DEFAULT_MODEL_ALIAS):
            raise APIError(404, f"the model {model!r} does not exist on this server; it serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ engine
    def submit(self, prompt: str, negative_prompt: str | None, params: Any, on_progress: ProgressFn | None = None,
               *, stream_previews: bool = False, preview_count: int | None = None, images: list | None = None):
        """Validate and queue one request; returns its handle or raises the matching APIError.

        ``stream_previews``: the client reads per-step previews (a streamed response); otherwise the engine
        computes none for it. ``preview_count``: only that many, spread over the steps (None: every step).

        The handle is taken at admission, so a request that ends before its reader starts still delivers
        its final output; ``handle.request`` is the request as the engine completed it (defaults, seed).
        """
        params = params.replace(output_type="pt")  # see media.pil_outputs
        if params.lora is not None:  # before the engine opens any file
            params = params.replace(lora=allowed_lora(params.lora, self.lora_names, self.lora_dirs))
        request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative_prompt, sampling_params=params,
                                       stream_previews=stream_previews, preview_count=preview_count,
                                       images=list(images or []))
        try:
            (handle,) = self.engine.submit([request], on_progress=on_progress)
        except OmniError as exc:
            if isinstance(exc, QueueFullError):
                self.metrics.count_refused("queue_full")
            raise admission_error(exc, self.retry_after_s) from None
        return handle

    def adjusted(self, sent: Any, handle: Any) -> list[str]:
        """What the model changed in a request as sent, said in the response and logged: a frame count off the
        model's multiple is rounded as diffusers and vLLM-Omni round it (``WanPipeline``), not refused."""
        made = handle.request.sampling_params
        if sent.num_frames is None or made.num_frames == sent.num_frames:
            return []
        note = (f"num_frames {sent.num_frames} was rounded to {made.num_frames}: {self.model_info.pipeline} makes "
                f"videos of num_frames - 1 a multiple of {self.model_info.frame_multiple}")
        logger.warning("request %s: %s", handle.request_id, note)
        return [note]

    def track(self, request_id: str) -> None:
        self._inflight.add(request_id)

    def untrack(self, request_id: str) -> None:
        self._inflight.discard(request_id)

    async def run_to_end(self, request: Any, handle: Any, kind: str = "image") -> Any:
        """The completed output of a tracked request (None if the client left; a failure raises its APIError)."""
        try:
            out = await self.final_output(request, handle)
        finally:
            self.untrack(handle.request_id)
        if out is None:
            return None
        if out.status != "completed":
            raise generation_failed(out, self.engine.is_dead)
        self.metrics.observe_generation(kind, out.metrics)
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
