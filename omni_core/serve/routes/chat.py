"""``POST /v1/chat/completions`` for image models: vLLM-Omni's image route, so clients written for it work unchanged.

The last user message is the prompt (a string, or text parts joined by spaces); its ``image_url`` parts (base64
data URLs) are input images for an edit model. Generation fields (``height``, ``width``, ``num_inference_steps``,
``negative_prompt``, ``seed``, the model's own fields...) come at the top level or inside ``extra_body`` (a raw
HTTP client sends that key as is). The reply is a chat completion whose assistant message carries the images as
``image_url`` parts, with the worker's peak memory in each part, in ``usage``, in ``metrics`` and at the top level
(where vLLM-Omni's benchmarks, newer and older, read it). A video model answers as vLLM-Omni's older server did:
``video_url`` parts holding ``data:video/mp4;base64,...`` (its text_to_video curl example and its older benchmark
use this route); ``/v1/videos`` is the job API.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omni_core.serve.media import mp4_bytes, pil_outputs, png_b64
from omni_core.serve.omni_server import current
from omni_core.serve.openapi import error_doc, error_docs
from omni_core.serve.bodies import read_json
from omni_core.serve.protocol import parse_chat_request
from omni_core.serve.protocol import with_timeout_header
from omni_core.serve.uploads import check_count, read_data_url

v1 = APIRouter(prefix="/v1", responses={401: error_doc("missing or incorrect API key")})


@v1.post("/chat/completions", responses={200: {"description": "a chat completion whose message holds the images"},
                                         **error_docs(400, 404, 413, 429, 500, 503),
    504: error_doc("the request did not finish within its timeout (the 'timeout' field, X-Request-Timeout)")},
         openapi_extra={"requestBody": {"required": True, "content": {
             "application/json": {"schema": {"type": "object", "required": ["messages"]}}}}})
async def chat_completions(request: Request):
    server = current(request)
    body = await read_json(request, server)
    model = server.model_of(body)
    chat = parse_chat_request(body, model_fields=model.info.sampling_fields, video=model.is_video,
                              fps_field=model.info.fps_field)
    req = chat.request
    model = server.model(req.model)
    check_count(list(chat.image_urls), "messages", model.image_input, model.name)
    images = [read_data_url(url, "messages", model.max_image_pixels) for url in chat.image_urls]
    handle = await model.submit(req.prompt, req.negative_prompt, with_timeout_header(req.params, request.headers),
                                images=images)
    warnings = model.adjusted(req.params, handle)
    server.track(handle.request_id, model)
    out = await server.run_to_end(request, handle, model, kind="video" if model.is_video else "image")
    if out is None:
        return Response(status_code=499)
    return JSONResponse(await asyncio.to_thread(chat_payload, out, model.name,
                                                chat.fps if model.is_video else None, warnings))


def chat_payload(out: Any, model: str, fps: int | None = None, warnings: list | None = None) -> dict[str, Any]:
    """The chat completion: image parts, or (``fps`` given: a video model) one MP4 ``video_url`` part per video;
    ``warnings``: what the model changed in the request (omni's field, present only then)."""
    peak = out.metrics.get("peak_memory_mb", 0.0)
    if fps is None:
        parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(im)}"},
                  "peak_memory_mb": peak} for im in pil_outputs(out)]
    else:
        videos = pil_outputs(out)
        sound = [None] * len(videos) if out.audio is None else list(out.audio)  # the model's sound track, if any
        parts = [{"type": "video_url", "video_url": {
                     "url": f"data:video/mp4;base64,{mp4_b64(frames, fps, audio, out.audio_sample_rate)}"},
                  "peak_memory_mb": peak} for frames, audio in zip(videos, sound)]
    payload = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "peak_memory_mb": peak,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": parts}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "peak_memory_mb": peak},
            "metrics": {"peak_memory_mb": peak, "seed": out.metrics.get("seed"),
                        "e2e_latency_s": out.metrics.get("e2e_latency_s")}}
    if warnings:
        payload["warnings"] = list(warnings)
    return payload


def mp4_b64(frames: Any, fps: int, audio: Any = None, sample_rate: int | None = None) -> str:
    """One video (a list of PIL frames, with its sound track if any) as a base64 MP4."""
    import base64

    return base64.b64encode(mp4_bytes(frames, fps, audio, sample_rate)).decode("ascii")


__all__ = ["chat_payload", "mp4_b64", "v1"]
