"""``/health`` and ``/metrics`` (open: no API key) and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from omni_core.serve.errors import dead_message
from omni_core.serve.omni_server import current
from omni_core.serve.openapi import error_doc

router = APIRouter()
v1 = APIRouter(prefix="/v1", responses={401: error_doc("missing or incorrect API key")})


@router.api_route("/health", methods=["GET", "HEAD"], responses={
    200: {"description": "the engine is alive (status ok, or degraded: its last request ran out of memory)"},
    503: error_doc("the engine is dead")})
async def health(request: Request):
    server = current(request)
    stats = server.engine.stats()
    if stats["dead"]:
        return JSONResponse({"status": "dead", "reason": dead_message(stats["dead"])}, status_code=503)
    state = {"model": server.model_name, "waiting": stats["waiting"], "running": stats["running"]}
    if stats.get("degraded"):  # still serving (200: keep it in rotation); the next completed request clears it
        return {"status": "degraded", "reason": stats["degraded"], **state}
    return {"status": "ok", **state}


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request):
    server = current(request)
    text = server.metrics.render(server.engine.stats(), model=server.model_name, video_jobs=server.videos.counts())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@v1.get("/models")
async def models(request: Request):
    server = current(request)
    return {"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": server.created, "owned_by": "omni",
        "pipeline": server.model_info.pipeline, "modality": "video" if server.is_video else "image",
        "streaming_previews": server.streaming, **playground_fields(server)}]}


def playground_fields(server) -> dict:
    """What a client (the playground page) needs to build a valid request: the size rule, the resolved
    request limits, the input images the model takes (None: none), the frame rule of a video model."""
    import attrs

    info = server.model_info
    image_input = info.image_input
    return {"size_multiple": info.size_multiple, "frame_multiple": info.frame_multiple if info.is_video else None,
            "limits": attrs.asdict(server.engine.limits),
            "image_input": None if image_input is None else {
                "min_images": image_input.min_images, "max_images": image_input.max_images,
                "role": image_input.role}}
