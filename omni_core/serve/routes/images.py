"""``POST /v1/images/generations`` and ``POST /v1/images/edits``: JSON with the images, or (``stream=true``)
server-sent events as OpenAI sends them: ``partial_images`` (0 to 3) previews spread over the steps, then a completed
event per image; named ``image_generation.*`` on generations and ``image_edit.*`` on edits. omni's extension
``step_previews: true`` streams a partial image after every denoising step instead.

A client that goes away aborts its request: non-streamed, a task watches for ``http.disconnect`` while the
result is awaited; streamed, the response stops on disconnect. So the engine never keeps work nobody reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import attrs
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_core.serve.errors import generation_failed, internal_error
from omni_core.serve.media import pil_outputs, png_b64, preview_image, size_of
from omni_core.serve.omni_server import OmniServer, current
from omni_core.serve.served_model import ServedModel
from omni_core.serve.errors import invalid
from omni_core.serve.openapi import edit_form_schema, error_doc, error_docs, image_body_schema
from omni_core.serve.protocol import (EDIT_IMAGE_FIELDS, EDIT_MASK_FIELD, ImageRequest, parse_edit_request,
                                      parse_image_request, partial_image_steps)
from omni_core.serve.bodies import read_json, read_multipart, read_urlencoded
from omni_core.serve.protocol import with_timeout_header
from omni_core.serve.uploads import check_count, read_image
from omni_core.serve.sse import EventStream, sse

logger = logging.getLogger("omni_core.serve")

v1 = APIRouter(prefix="/v1", responses={401: error_doc("missing or incorrect API key")})


@v1.post("/images/generations", responses={
    200: {"description": "the images (JSON), or with stream=true Server-Sent Events",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    **error_docs(400, 404, 413, 429, 500, 503),
    504: error_doc("the request did not finish within its timeout (the 'timeout' field, X-Request-Timeout)")},
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": image_body_schema(())}}}})  # + the served model's fields: openapi.py
async def generate_images(request: Request):
    server = current(request)
    body = await read_json(request, server)
    req = parse_image_request(body, model_fields=server.model_of(body).info.sampling_fields)
    return await answer_images(request, server, req, GENERATION_EVENTS)


#: the event-name prefix of each route's stream, as OpenAI names them
GENERATION_EVENTS = "image_generation"
EDIT_EVENTS = "image_edit"


@v1.post("/images/edits", responses={
    200: {"description": "the edited images (JSON), or with stream=true Server-Sent Events",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    **error_docs(400, 404, 413, 429, 500, 503),
    504: error_doc("the request did not finish within its timeout (the 'timeout' field, X-Request-Timeout)")},
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": edit_form_schema(())}}}})  # + the served model's fields: openapi.py
async def edit_images(request: Request):
    """OpenAI's image edit: a multipart form with the input image(s) (``image`` or ``image[]``), the prompt and
    the generation fields; answered as generations are (JSON, or events with ``stream=true``)."""
    server = current(request)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        fields, files = await read_multipart(request, server, content_type)
    elif content_type.startswith("application/x-www-form-urlencoded"):  # a form without files (then refused)
        fields, files = await read_urlencoded(request, server), {}
    else:
        raise invalid("POST /v1/images/edits takes a multipart/form-data body (the image files, the prompt and the "
                      "fields), as OpenAI's API does", None, code="invalid_body")
    for name in (*EDIT_IMAGE_FIELDS, EDIT_MASK_FIELD):
        if name in fields:
            raise invalid(f"'{name}' must be an image file (a multipart file part with a filename), got a text "
                          f"field", "image" if name != EDIT_MASK_FIELD else name, code="invalid_image")
    unknown_files = sorted(set(files) - {*EDIT_IMAGE_FIELDS, EDIT_MASK_FIELD})
    if unknown_files:
        raise invalid(f"unexpected file field '{unknown_files[0]}'; an edit takes 'image' (or 'image[]') and "
                      f"optionally 'mask'", unknown_files[0], code="unknown_parameter")
    req = parse_edit_request(fields, model_fields=server.model_of(fields).info.sampling_fields)
    model = server.model(req.model)
    if EDIT_MASK_FIELD in files:
        raise invalid(f"'mask' is not supported by model {model.name!r}: it edits the whole image from the "
                      f"prompt (no inpainting mask); leave 'mask' out", EDIT_MASK_FIELD, code="unsupported_parameter")
    parts = [data for name in EDIT_IMAGE_FIELDS for data in files.get(name, [])]
    if model.image_input is None:
        raise invalid(f"model {model.name!r} does not edit images (it takes no input image); use "
                      f"POST /v1/images/generations", "image", code="unsupported_model")
    check_count(parts, "image", model.image_input, model.name)
    images = [read_image(data, "image", model.max_image_pixels) for data in parts]
    return await answer_images(request, server, attrs.evolve(req, images=tuple(images)), EDIT_EVENTS)


async def answer_images(request: Request, server: OmniServer, req: ImageRequest, events: str = GENERATION_EVENTS):
    """Run an image request (generation or edit) on the model it names and answer it: JSON, or events (named
    ``events``.partial_image, ``events``.completed) when ``req.stream``."""
    model = server.model(req.model)
    req = attrs.evolve(req, params=with_timeout_header(req.params, request.headers))
    if model.is_video:
        raise invalid(f"model {model.name!r} makes videos; use POST /v1/videos", "model",
                      code="unsupported_model")
    if req.stream and not model.streaming:
        raise invalid("stream=true needs a server that runs its engine with streaming output (omni serve does "
                      "unless started with --no-stream-previews; the pipeline must support step execution)",
                      "stream", code="unsupported_value")
    handle = await model.submit(req.prompt, req.negative_prompt, req.params, stream_previews=req.wants_previews,
                                preview_count=None if req.step_previews else req.partial_images,
                                images=list(req.images))
    rid = handle.request_id
    server.track(rid, model)
    if req.stream:
        state = {"finished": False}
        # the request as the engine completed it (model defaults such as the size filled in)
        req = attrs.evolve(req, params=handle.request.sampling_params, images=())

        def on_close() -> None:
            server.untrack(rid)
            if not state["finished"]:  # the client left (or the stream failed) before the end
                if not state.get("server_error"):
                    server.metrics.count_disconnect()
                handle.abort()

        return EventStream(image_events(server, model, req, handle, state, events), on_close)
    out = await server.run_to_end(request, handle, model)
    if out is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    return JSONResponse(await asyncio.to_thread(image_payload, out))


def image_payload(out: Any) -> dict[str, Any]:
    images = pil_outputs(out)
    return {"created": int(time.time()), "data": [{"b64_json": png_b64(im), "revised_prompt": None}
                                                  for im in images],
            "output_format": "png", "size": size_of(images[0]) if images else None,
            "seed": out.metrics.get("seed"), "usage": usage(out),
            # where vLLM-Omni's older serving benchmark reads it (its newer one reads usage.peak_memory_mb)
            "peak_memory_mb": out.metrics.get("peak_memory_mb", 0.0)}


def usage(out: Any) -> dict[str, Any]:
    """OpenAI's token usage (zero: no tokens are billed here) and the worker's peak memory, where vLLM-Omni puts it."""
    return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "peak_memory_mb": out.metrics.get("peak_memory_mb", 0.0)}


async def image_events(server: OmniServer, model: ServedModel, req: ImageRequest, handle: Any, state: dict,
                       events: str = GENERATION_EVENTS):
    """Server-sent events: the partial images (``req.partial_images`` of the engine's per-step previews, spread
    over the steps; or, with ``req.step_previews``, every one), then one completed event per image.

    A failure while streaming ends the stream with an ``error`` event (what the ``openai`` client raises)."""
    try:
        async for event in _image_events(server, model, req, handle, state, events):
            yield event
    except Exception as exc:  # noqa: BLE001 - e.g. an image that cannot be encoded
        logger.exception("streaming request %s failed", handle.request_id)
        state["server_error"] = True
        yield sse("error", internal_error(exc, "streaming failed").body())


async def _image_events(server: OmniServer, model: ServedModel, req: ImageRequest, handle: Any, state: dict,
                        events: str):
    index = 0
    common = {"quality": "auto", "background": "opaque", "output_format": "png"}
    size = f"{req.params.width}x{req.params.height}"
    partial, completed = f"{events}.partial_image", f"{events}.completed"
    while True:
        out = await handle.aget()
        if not out.finished:
            # the engine computed previews only after these steps (the request's preview_count); the model's
            # step count is the output's, whether or not the request named one
            if out.preview is None or (not req.step_previews
                                       and out.step_index not in partial_image_steps(req.partial_images,
                                                                                     out.num_steps or 0)):
                continue
            image = await asyncio.to_thread(lambda: png_b64(preview_image(out.preview, server.preview_max_side)))
            yield sse(partial, {
                "type": partial, "b64_json": image,
                "partial_image_index": index, "step": out.step_index, "num_steps": out.num_steps,
                "created_at": int(time.time()), "size": size, **common})
            index += 1
            continue
        state["finished"] = True
        if out.status != "completed":
            yield sse("error", generation_failed(out, model.engine.is_dead, model.failure_prefix()).body())
            return
        server.metrics.observe_generation("image", out.metrics, model=model.name)
        images = await asyncio.to_thread(pil_outputs, out)
        encoded = await asyncio.to_thread(lambda: [png_b64(im) for im in images])
        for k, b64 in enumerate(encoded):
            yield sse(completed, {
                "type": completed, "b64_json": b64, "index": k,
                "seed": out.metrics.get("seed"), "created_at": int(time.time()),
                "size": size_of(images[k]), **common, "usage": usage(out)})
        return
