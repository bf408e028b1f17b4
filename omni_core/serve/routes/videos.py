"""``/v1/videos``: create a job (JSON, a multipart form, or a url-encoded form as aiohttp sends one), list, get,
download the MP4, delete (cancels it); ``/v1/videos/sync`` (vLLM-Omni's): the same request, answered with the MP4
itself once made. An image-to-video model takes its input image as ``input_reference`` (a file part, or a base64
data URL) or as vLLM-Omni's ``image_reference`` (``{"image_url": "data:..."}``).

A job follows its engine request on a task of the server's loop and writes the MP4 when it completes;
the engine's progress callback moves it to ``in_progress`` with a percentage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from omni_core.serve.media import mp4_bytes, pil_outputs
from omni_core.serve.served_model import ServedModel
from omni_core.serve.omni_server import OmniServer, current
from omni_core.serve.errors import APIError, invalid
from omni_core.serve.openapi import error_doc, error_docs, form_schema, video_body_schema
from omni_core.serve.protocol import with_timeout_header
from omni_core.serve.bodies import read_json, read_multipart, read_urlencoded
from omni_core.serve.protocol import IMAGE_REFERENCE, INPUT_REFERENCE, VideoRequest, parse_video_request
from omni_core.serve.uploads import check_count, read_data_url, read_image
from omni_core.serve.videos import CANCELLED, COMPLETED, FAILED, VideoJob

logger = logging.getLogger("omni_core.serve")

v1 = APIRouter(prefix="/v1", responses={401: error_doc("missing or incorrect API key")})


_VIDEO_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": video_body_schema(())},  # + the served model's fields: openapi.py
    "multipart/form-data": {"schema": form_schema(video_body_schema(()))},
    "application/x-www-form-urlencoded": {"schema": form_schema(video_body_schema(()))}}}}


async def read_video_request(request: Request, server: OmniServer) -> tuple[VideoRequest, list, ServedModel]:
    """The body of ``POST /v1/videos`` (and ``/sync``) in any of its three encodings, checked against the model
    it names, with its input image (none, or one PIL image) and that model."""
    content_type = request.headers.get("content-type", "")
    reference: Any = None  # the input image: a file part, or a data URL in a text field

    def fields_of(body: Any) -> dict[str, Any]:
        info = server.model_of(body).info
        return {"frame_multiple": info.frame_multiple, "model_fields": info.sampling_fields,
                "fps_field": info.fps_field}

    if content_type.startswith("multipart/form-data"):
        body, files = await read_multipart(request, server, content_type)
        model_options = fields_of(body)
        unknown = sorted(set(files) - {INPUT_REFERENCE})
        if unknown:
            raise invalid(f"unexpected file field '{unknown[0]}'; a video job takes one file, 'input_reference'",
                          unknown[0], code="unknown_parameter")
        if len(files.get(INPUT_REFERENCE, [])) > 1:
            raise invalid("'input_reference' takes one image", INPUT_REFERENCE, code="invalid_image_count")
        reference = files[INPUT_REFERENCE][0] if INPUT_REFERENCE in files else body.pop(INPUT_REFERENCE, None)
        req = parse_video_request(body, from_form=True, **model_options)
    elif content_type.startswith("application/x-www-form-urlencoded"):  # aiohttp's form without files
        body = await read_urlencoded(request, server)
        reference = body.pop(INPUT_REFERENCE, None)
        req = parse_video_request(body, from_form=True, **fields_of(body))
    else:
        body = await read_json(request, server)
        if isinstance(body, dict) and INPUT_REFERENCE in body:
            body = dict(body)
            reference = body.pop(INPUT_REFERENCE)
        req = parse_video_request(body, **fields_of(body))
    model = server.model(req.model)
    if not model.is_video:
        raise invalid(f"model {model.name!r} makes images, not videos; use POST /v1/images/generations",
                      "model", code="unsupported_model")
    field = INPUT_REFERENCE
    if req.image_reference is not None:
        if reference not in (None, ""):
            raise invalid(f"give either '{INPUT_REFERENCE}' or '{IMAGE_REFERENCE}', not both", IMAGE_REFERENCE)
        reference, field = req.image_reference, IMAGE_REFERENCE
    images = [] if reference in (None, "") else [reference]
    if images and model.image_input is None:
        raise invalid(f"model {model.name!r} makes videos from text alone (it takes no input image); "
                      f"remove '{field}'", field, code="unsupported_parameter")
    check_count(images, field, model.image_input, model.name)
    images = [read_image(ref, field, model.max_image_pixels) if isinstance(ref, (bytes, bytearray))
              else read_data_url(ref, field, model.max_image_pixels) for ref in images]
    return req, images, model


@v1.post("/videos", responses={200: {"description": "the video job"}, **error_docs(400, 404, 413, 429, 503)},
         openapi_extra=_VIDEO_BODY)
async def create_video(request: Request):
    server = current(request)
    req, images, model = await read_video_request(request, server)
    server.videos.sweep()
    job: VideoJob | None = None

    def on_progress(request_id: str, step: int, total: int) -> None:  # engine thread
        if job is not None:
            job.on_step(step, total)

    handle = await model.submit(req.prompt, req.negative_prompt, with_timeout_header(req.params, request.headers),
                                on_progress=on_progress, images=images)
    params = handle.request.sampling_params
    job = VideoJob(id=server.videos.new_id(), model=model.name, prompt=req.prompt,
                   size=f"{params.width}x{params.height}",
                   seconds=req.seconds or f"{params.num_frames / req.fps:g}", num_frames=params.num_frames,
                   fps=req.fps, request_id=handle.request_id, seed=params.seed,
                   warnings=model.adjusted(req.params, handle))
    try:
        server.videos.add(job)
    except APIError:
        handle.abort()
        raise
    job.task = asyncio.create_task(run_video_job(server, job, handle, model))
    return job.to_dict()


@v1.post("/videos/sync", response_class=Response, openapi_extra=_VIDEO_BODY, responses={
    200: {"description": "the MP4 (headers: X-Request-Id, X-Model, X-Inference-Time-S)",
          "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
    **error_docs(400, 404, 413, 429, 500, 503)})
async def create_video_sync(request: Request):
    """vLLM-Omni's synchronous route (for benchmarks): the same fields as ``POST /v1/videos``, answered with the
    MP4 bytes once made, as vLLM-Omni does (``video/mp4``, ``X-Request-Id``, ``X-Model``, ``X-Inference-Time-S``;
    omni adds ``X-Omni-Warning`` when the model changed the request, e.g. rounded ``num_frames``)."""
    server = current(request)
    started = time.perf_counter()
    req, images, model = await read_video_request(request, server)
    handle = await model.submit(req.prompt, req.negative_prompt, with_timeout_header(req.params, request.headers),
                                images=images)
    warnings = model.adjusted(req.params, handle)
    server.track(handle.request_id, model)
    out = await server.run_to_end(request, handle, model, kind="video")
    if out is None:
        return Response(status_code=499)
    (frames,) = await asyncio.to_thread(pil_outputs, out)
    data = await asyncio.to_thread(mp4_bytes, frames, req.fps)
    headers = {"X-Request-Id": handle.request_id, "X-Model": model.name,
               "X-Inference-Time-S": f"{time.perf_counter() - started:.3f}"}
    if warnings:
        headers["X-Omni-Warning"] = "; ".join(warnings)
    return Response(content=data, media_type="video/mp4", headers=headers)


@v1.get("/videos")
async def list_videos(request: Request):
    jobs = current(request).videos.list()
    return {"object": "list", "data": [j.to_dict() for j in jobs],
            "first_id": jobs[0].id if jobs else None, "last_id": jobs[-1].id if jobs else None,
            "has_more": False}


@v1.get("/videos/{video_id}", responses=error_docs(404))
async def get_video(video_id: str, request: Request):
    return current(request).videos.get(video_id).to_dict()


@v1.get("/videos/{video_id}/content", response_class=FileResponse, responses={
    200: {"description": "the MP4", "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}},
    **error_docs(400, 404, 409)})
async def get_video_content(video_id: str, request: Request, variant: str = "video"):
    job = current(request).videos.get(video_id)
    if variant != "video":
        raise invalid(f"variant={variant!r} is not supported; only 'video'", "variant",
                      code="unsupported_value")
    if job.status != COMPLETED or job.path is None:
        raise APIError(409, f"video {video_id} is {job.status}; its content is available once completed",
                       param="video_id", code="video_not_ready")
    return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")


@v1.delete("/videos/{video_id}", responses=error_docs(404))
async def delete_video(video_id: str, request: Request):
    job = current(request).videos.remove(video_id)  # cancels a running job: its engine request is aborted
    if job.task is not None:
        await asyncio.gather(job.task, return_exceptions=True)
    return {"id": job.id, "object": "video.deleted", "deleted": True, "status": job.status}


async def run_video_job(server: OmniServer, job: VideoJob, handle: Any, model: ServedModel) -> None:
    """Follow the job's request to its end and write the MP4 (the task is cancelled on delete)."""
    from omni_core.utils.media import write_video

    finished = False
    try:
        out = await handle.aresult()
        finished = True
        if out.status != "completed":
            status = CANCELLED if out.status == "aborted" else FAILED
            job.finish(status, server.videos.ttl_s, None if status == CANCELLED else
                       {"code": "generation_failed", "message": f"{model.failure_prefix()}{out.error}"})
            return
        server.metrics.observe_generation("video", out.metrics, model=model.name)
        job.seed = out.metrics.get("seed")
        job.peak_memory_mb = out.metrics.get("peak_memory_mb", 0.0)
        (frames,) = await asyncio.to_thread(pil_outputs, out)
        if not isinstance(frames, list):  # an image model's output: one frame
            frames = [frames]
        path = server.videos.path_for(job.id)
        audio = None if out.audio is None else out.audio[0]  # the model's sound track (LTX-2), muxed in
        write = asyncio.get_running_loop().run_in_executor(
            None, functools.partial(write_video, frames, path, job.fps, audio=audio, sample_rate=out.audio_sample_rate))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:  # deleted while writing: remove the file once it is written
            write.add_done_callback(lambda _: _remove(path))
            raise
        job.path = path
        if job.id not in server.videos:  # deleted meanwhile
            _remove(path)
        job.finish(COMPLETED, server.videos.ttl_s)
    except asyncio.CancelledError:
        if not finished:
            handle.abort()
        job.status = CANCELLED
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. the MP4 writer is missing; the job fails, not the server
        logger.exception("video job %s failed", job.id)
        job.finish(FAILED, server.videos.ttl_s, {"code": "encoding_failed", "message": f"{type(exc).__name__}: {exc}"})


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
