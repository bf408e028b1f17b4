"""The OpenAI-compatible HTTP app: ``build_app(engine)`` -> a FastAPI app running requests on that engine.

The engine runs in the server process and is used only through its client interface
(:mod:`omni_core.engine.client`); each HTTP request becomes one engine request, read through its handle
on the server's event loop. A full engine queue answers 429 with ``Retry-After``.

When the engine runs with ``streaming_output=True`` (``omni serve`` does, if the pipeline can run step by
step) every request runs step-wise and yields a preview per step; a non-streamed request just skips them,
so its image is the same as the streamed one (the tests check this bit for bit, also against an engine
without streaming).

The parts: ``omni_server`` (shared state, lifecycle), ``routes/`` (system, images, videos), ``sse``,
``errors`` (every error mapping), ``openapi``, ``middleware``. This module imports FastAPI;
``omni_core.serve`` loads it only when ``build_app`` is first used.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from fastapi import FastAPI

from omni_core.serve.errors import install_error_handlers
from omni_core.serve.middleware import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from omni_core.serve.omni_server import MAX_BODY_BYTES, MAX_UPLOAD_BYTES, PREVIEW_MAX_SIDE, SHUTDOWN_GRACE_S, OmniServer
from omni_core.serve.openapi import install_openapi
from omni_core.serve.bodies import MAX_FORM_PARTS, MAX_JSON_DEPTH, MAX_JSON_ELEMENTS
from omni_core.serve.routes import chat, images, rollout, system, videos
from omni_core.serve.routes import playground

__all__ = ["MAX_BODY_BYTES", "MAX_UPLOAD_BYTES", "PREVIEW_MAX_SIDE", "SHUTDOWN_GRACE_S", "OmniServer", "build_app"]


def build_app(engine_or_omni: Any, *, served_model_name: str | None = None, api_key: str | None = None,
              video_dir: str | None = None, max_video_jobs: int = 100, video_ttl_s: float = 3600.0,
              retry_after_s: int = 1, close_engine: bool = False, preview_max_side: int = PREVIEW_MAX_SIDE,
              max_body_bytes: int = MAX_BODY_BYTES, shutdown_grace_s: float = SHUTDOWN_GRACE_S,
              exit_on_engine_death: bool = False, max_upload_bytes: int = MAX_UPLOAD_BYTES,
              max_form_parts: int = MAX_FORM_PARTS, max_json_depth: int = MAX_JSON_DEPTH,
              max_json_elements: int = MAX_JSON_ELEMENTS, lora_dirs: Sequence[str] = (),
              rollout_limits: Any = None) -> Any:
    """A FastAPI app serving ``engine_or_omni``: an ``EngineClient`` such as ``DiffusionEngine``, an
    ``AsyncOmni`` / ``Omni`` (whose engine is used), or several models -- a ``ModelFleet`` (``start_fleet``), an
    ``Omni`` over several models, or a mapping name -> ``EngineClient``; every route serves the model its
    request names (``model``; none or ``"default"``: the first).

    ``served_model_name``: the ``model`` clients name (default: the engine's ``model``). ``api_key``: when
    set, every route but ``/health``, ``/metrics`` and the playground page needs ``Authorization: Bearer <key>`` (checked before
    routing, so unknown routes are 401 too); an empty key is refused. ``video_dir``: where MP4s go (default: a
    temp dir removed at shutdown). ``close_engine``: close the engine when the app shuts down (``omni serve``
    owns its engine; tests usually own theirs). ``max_body_bytes``: larger bodies get 413 (counted while
    read); ``max_upload_bytes`` is the cap of the routes that take input images. ``shutdown_grace_s``: at shutdown, requests still running after this long are aborted through the
    engine and answered with an error. ``exit_on_engine_death``: stop serving once the engine is dead.
    ``max_form_parts``, ``max_json_depth``, ``max_json_elements``: what a body may hold before it is parsed (more
    parts or elements: 413; deeper: 400). ``lora_dirs``: folders whose adapter files a request's ``lora`` may name
    (default none: only the engine's preloaded adapter names). ``rollout_limits``: what one ``/rollout/generate``
    request may ask back (``omni_core.serve.routes.rollout.RolloutLimits``; default its defaults).
    """
    server = OmniServer(engine_or_omni, served_model_name=served_model_name, api_key=api_key, video_dir=video_dir,
                        max_video_jobs=max_video_jobs, video_ttl_s=video_ttl_s, retry_after_s=retry_after_s,
                        close_engine=close_engine, preview_max_side=preview_max_side, max_body_bytes=max_body_bytes,
                        shutdown_grace_s=shutdown_grace_s, exit_on_engine_death=exit_on_engine_death,
                        max_upload_bytes=max_upload_bytes, max_form_parts=max_form_parts,
                        max_json_depth=max_json_depth, max_json_elements=max_json_elements, lora_dirs=lora_dirs)

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
    server.rollout_limits = rollout_limits or rollout.RolloutLimits()
    install_error_handlers(app)
    for router in (system.router, system.v1, images.v1, videos.v1, chat.v1, rollout.router):  # OpenAPI's order
        app.include_router(router)
    app.include_router(playground.router)  # the browser page at / and /playground (not in the OpenAPI document)
    fields = {f.name: f for m in server.models.values() for f in m.info.sampling_fields}  # every model's, once
    install_openapi(app, server.api_key, tuple(fields.values()))
    # outermost first: metrics (counts every answer), the API key (before routing), the body cap
    app.add_middleware(BodyLimitMiddleware, limit=server.max_body_bytes, upload_limit=server.max_upload_bytes)
    app.add_middleware(AuthMiddleware, server=server)
    app.add_middleware(MetricsMiddleware, metrics=server.metrics)
    return app
