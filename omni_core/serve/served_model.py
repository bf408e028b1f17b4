"""``ServedModel``: one model a server serves, as its routes see it -- its name, its engine client, what it takes.

A server serves one engine, or several models (a ``ModelFleet``: ``omni serve`` with several models or a models
file); either way every route picks its ``ServedModel`` by the request's ``model`` (``OmniServer.model``) and
uses only that. Submitting to a fleet's model may first bring it onto the device (a load, or a copy from host
memory) or wait for room, so it runs off the event loop, on the server's admission threads.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from omni_core.engine.client import EngineClient, ProgressFn
from omni_core.errors import OmniError, QueueFullError, ResidencyError
from omni_core.request import OmniDiffusionRequest
from omni_core.serve.errors import APIError, admission_error
from omni_core.serve.lora_access import allowed_lora

logger = logging.getLogger("omni_core.serve")


class ServedModel:
    """One served model: ``name`` (what requests give as ``model``), ``engine`` and what its routes check."""

    def __init__(self, name: str, engine: EngineClient, server: Any, *, moves: bool = False) -> None:
        self.name, self.engine, self.server = name, engine, server
        #: submitting may move the model (a fleet's member): done on the server's admission threads
        self.moves = moves
        self.info = engine.model_info
        self.is_video = self.info.is_video
        self.streaming = self.info.streaming
        #: the input images the model takes (None: none) and the per-image pixel limit
        self.image_input = self.info.image_input
        self.max_image_pixels = engine.limits.max_image_pixels
        self.lora_names = dict(getattr(getattr(engine, "config", None), "loras", None) or {})

    async def submit(self, prompt: str, negative_prompt: str | None, params: Any,
                     on_progress: ProgressFn | None = None, *, stream_previews: bool = False,
                     preview_count: int | None = None, images: list | None = None):
        """Validate and queue one request; returns its handle or raises the matching APIError.

        ``stream_previews``: the client reads per-step previews (a streamed response); otherwise the engine
        computes none for it. ``preview_count``: only that many, spread over the steps (None: every step).

        The handle is taken at admission, so a request that ends before its reader starts still delivers
        its final output; ``handle.request`` is the request as the engine completed it (defaults, seed).
        """
        server = self.server
        params = params.replace(output_type="pt")  # see media.pil_outputs
        if params.lora is not None:  # before the engine opens any file
            params = params.replace(lora=allowed_lora(params.lora, self.lora_names, server.lora_dirs))
        request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative_prompt, sampling_params=params,
                                       stream_previews=stream_previews, preview_count=preview_count,
                                       images=list(images or []))
        try:
            if self.moves:
                self.engine.prepare_request(request)  # a bad request is refused before any model moves
                (handle,) = await asyncio.get_running_loop().run_in_executor(
                    server.admission_pool(), lambda: self.engine.submit([request], on_progress=on_progress))
            else:
                (handle,) = self.engine.submit([request], on_progress=on_progress)
        except ResidencyError as exc:
            server.metrics.count_refused("model_busy")
            raise APIError(503, str(exc), code="model_busy", type="server_error",
                           headers={"Retry-After": str(server.retry_after_s)}) from None
        except OmniError as exc:
            if isinstance(exc, QueueFullError):
                server.metrics.count_refused("queue_full")
            raise admission_error(exc, server.retry_after_s) from None
        return handle

    def adjusted(self, sent: Any, handle: Any) -> list[str]:
        """What the model changed in a request as sent, said in the response and logged: a frame count off the
        model's multiple is rounded as diffusers and vLLM-Omni round it (``WanPipeline``), not refused."""
        made = handle.request.sampling_params
        if sent.num_frames is None or made.num_frames == sent.num_frames:
            return []
        note = (f"num_frames {sent.num_frames} was rounded to {made.num_frames}: {self.info.pipeline} makes "
                f"videos of num_frames - 1 a multiple of {self.info.frame_multiple}")
        logger.warning("request %s: %s", handle.request_id, note)
        return [note]

    def failure_prefix(self) -> str:
        """What a failure message starts with: the model's name where a server serves several."""
        return f"model {self.name!r}: " if len(self.server.models) > 1 else ""

    def describe(self, state: dict | None = None) -> dict[str, Any]:
        """This model's entry of ``GET /v1/models``: what a client needs to build a valid request, and where the
        model is (``state``: on the ``device``, kept in ``host`` memory, ``cold``: not loaded; and its bytes)."""
        import attrs

        info, image_input = self.info, self.image_input
        entry = {"id": self.name, "object": "model", "created": self.server.created, "owned_by": "omni",
                 "pipeline": info.pipeline, "modality": "video" if self.is_video else "image",
                 "streaming_previews": self.streaming, "size_multiple": info.size_multiple,
                 "frame_multiple": info.frame_multiple if self.is_video else None,
                 "limits": attrs.asdict(self.engine.limits),
                 "image_input": None if image_input is None else {
                     "min_images": image_input.min_images, "max_images": image_input.max_images,
                     "role": image_input.role}}
        if state is not None:
            entry["state"] = state["state"]
            entry["bytes"] = {"weights": state["weight_bytes"], "working": state["working_bytes"],
                              "measured": state["measured"]}
            entry["pinned"] = state["pinned"]
            if state.get("dead_reason") and state["state"] == "dead":
                entry["dead_reason"] = state["dead_reason"]
        return entry


__all__ = ["ServedModel"]
