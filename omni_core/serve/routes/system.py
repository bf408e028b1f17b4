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
    200: {"description": "the engine is alive (status ok, or degraded: its last request ran out of memory); a "
                         "server of several models is ok while any serves, and says which are dead"},
    503: error_doc("the engine is dead (every model's, on a server of several)")})
async def health(request: Request):
    server = current(request)
    if server.fleet is not None:
        return fleet_health(server)
    stats = server.default.engine.stats()
    if stats["dead"]:
        return JSONResponse({"status": "dead", "reason": dead_message(stats["dead"])}, status_code=503)
    state = {"model": server.default.name, "waiting": stats["waiting"], "running": stats["running"]}
    if stats.get("degraded"):  # still serving (200: keep it in rotation); the next completed request clears it
        return {"status": "degraded", "reason": stats["degraded"], **state}
    return {"status": "ok", **state}


def fleet_health(server) -> JSONResponse | dict:
    """Several models: a model whose engine died is restarted by its next request (``restart="on_request"``), so
    the server stays in rotation; it is dead only when every model is dead for good."""
    states = {s["name"]: s for s in server.fleet.states()}
    restart = server.fleet.residency.restart == "on_request"
    dead = {name for name, s in states.items() if s["state"] == "dead"}
    models = {name: {"state": s["state"], **({"reason": dead_message(s["dead_reason"])} if name in dead else {})}
              for name, s in states.items()}
    if len(dead) == len(states) and not restart:
        return JSONResponse({"status": "dead", "reason": "every model is dead", "models": models}, status_code=503)
    return {"status": "degraded" if dead else "ok", "models": models}


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request):
    server = current(request)
    stats = {name: model.engine.stats() for name, model in server.models.items()}
    text = server.metrics.render(stats, video_jobs=server.videos.counts(),
                                 residency=server.fleet.states() if server.fleet is not None else ())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@v1.get("/models")
async def models(request: Request):
    """Every served model: what a client needs to build a valid request and, on a server of several, where the
    model is (``state``: device, host, cold, loading, evicting, unloading, dead) and its bytes."""
    server = current(request)
    states = {s["name"]: s for s in server.fleet.states()} if server.fleet is not None else {}
    return {"object": "list", "data": [model.describe(states.get(name)) for name, model in server.models.items()]}
