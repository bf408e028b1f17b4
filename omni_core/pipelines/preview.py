"""Previews that look like the picture: a per-model linear latent-to-RGB projection, an optional tiny decoder.

A streamed preview is ``pipeline.preview(state)``: an RGB ``[3, h, w]`` tensor in [0, 1] at the latent grid's
size, cheap enough for every step. :func:`render_preview` makes it for any pipeline that says which latent
image to show (``preview_latents(state)``: ``[C, h, w]`` for an image, ``[C, F, h, w]`` for a video):

1. **Source**: the step's clean estimate ``x0`` (flow matching: ``sample - sigma * velocity``, kept by
   :func:`~omni_core.pipelines.state.remember_flow_step`), which is what the final decode will look like; the
   noisy current latents only before the first step or with a scheduler that is not flow matching.
2. **Decoder**: a tiny decoder (diffusers' ``AutoencoderTiny``) when the engine option ``preview_decoder``
   names a folder holding one; else the model's **projection** ``rgb = W @ latent + b`` (``W``: ``3 x C``),
   read from the model folder's ``preview_projection.json`` (written by ``omni preview calibrate --write``),
   else from the projections the model plugin ships (``OmniPipeline.preview_projections``, a
   ``"package:file.json"`` resource whose entries name the VAE config they are for); else today's fallback,
   the first three latent channels min-max scaled (:func:`channel_preview`).
3. **Video**: up to four latent frames, evenly spaced, each projected, tiled 2x2 (``[3, 2h, 2w]``): still one
   RGB image of the video's aspect ratio, so every caller (PNG encoding, SSE, the playground) is unchanged;
   :func:`preview_frames` returns the frames themselves.

A projection is fitted by least squares (:func:`fit_projection`) on pairs (clean-estimate latents, VAE decode
of them, area-averaged to the latent grid) from a few runs of the model itself (:func:`collect_pairs`), so it
is right for the model's own VAE, random-weight test models included. Docs: ``docs/previews.md``.

This module renders; the projection record and where a model's comes from are
:mod:`~omni_core.pipelines.preview_projection` (its names re-exported here), the fitting
:mod:`~omni_core.pipelines.preview_fit`.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from omni_core.pipelines.preview_projection import (PROJECTION_FILE, LatentProjection, declared_projections,
                                                    find_projection, read_projection, vae_config_of,
                                                    write_projection)

#: frames a video preview shows (tiled 2x2)
VIDEO_PREVIEW_FRAMES = 4

logger = logging.getLogger(__name__)


def channel_preview(latents: Any) -> Any:
    """The preview before projections (kept as the fallback and the bench's baseline): ``[C, h, w]`` -> the
    first three channels (repeated when fewer), each min-max scaled; a ``[C, F, h, w]`` video shows its middle
    frame."""
    if latents.dim() == 4:
        latents = latents[:, latents.shape[1] // 2]
    lat = latents.float()
    rgb = lat[:3] if lat.shape[0] >= 3 else lat[:1].expand(3, -1, -1)
    lo = rgb.amin(dim=(1, 2), keepdim=True)
    hi = rgb.amax(dim=(1, 2), keepdim=True)
    return ((rgb - lo) / (hi - lo).clamp_min(1e-6)).cpu()


def frame_indices(num_frames: int, k: int = VIDEO_PREVIEW_FRAMES) -> list[int]:
    """``k`` evenly spaced frame indices from first to last (fewer frames: all of them)."""
    if num_frames <= k:
        return list(range(num_frames))
    return [round(i * (num_frames - 1) / (k - 1)) for i in range(k)]


def tile_frames(frames: Any) -> Any:
    """``[k, 3, h, w]`` (k <= 4) -> one ``[3, h, w]`` (k = 1) or a 2x2 grid ``[3, 2h, 2w]`` (missing cells
    repeat the last frame), which keeps the video's aspect ratio."""
    import torch

    k = frames.shape[0]
    if k == 1:
        return frames[0]
    cells = [frames[min(i, k - 1)] for i in range(4)]
    return torch.cat([torch.cat(cells[:2], dim=2), torch.cat(cells[2:], dim=2)], dim=1)


class TinyDecoder:
    """diffusers' ``AutoencoderTiny`` (TAESD-style) loaded from a folder: decodes preview latents (the same
    normalized latents the transformer sees, ``[C, h, w]``) to full-size RGB in [0, 1]."""

    def __init__(self, folder: str, device: Any = "cpu", dtype: Any = None) -> None:
        import torch
        from diffusers import AutoencoderTiny

        self.folder = folder
        self.model = AutoencoderTiny.from_pretrained(folder).to(device, dtype or torch.float32).eval()
        self.channels = int(self.model.config.latent_channels)

    def decode(self, latents: Any) -> Any:
        import torch

        p = next(self.model.parameters())
        with torch.no_grad():
            out = self.model.decode(latents[None].to(p.device, p.dtype), return_dict=False)[0][0]
        return ((out.float() + 1) / 2).clamp(0, 1)  # AutoencoderTiny.decode gives [-1, 1]


def _preview_plan(pipeline: Any, channels: int) -> tuple[str, Any]:
    """("decoder", TinyDecoder) / ("projection", LatentProjection) / ("channels", None), cached on the
    pipeline per channel count (found once, at the first preview)."""
    cache = pipeline.__dict__.setdefault("_omni_preview_plans", {})
    if channels in cache:
        return cache[channels]
    plan: tuple[str, Any] = ("channels", None)
    folder = getattr(pipeline, "omni_preview_decoder", None)
    if folder:
        try:
            dec = TinyDecoder(folder, getattr(pipeline, "device", "cpu"))
            if dec.channels == channels:
                plan = ("decoder", dec)
            else:
                logger.warning("preview_decoder %s decodes %d latent channels, the model has %d: using the "
                               "projection instead", folder, dec.channels, channels)
        except Exception as exc:  # noqa: BLE001 -- a preview must never fail a request
            logger.warning("preview_decoder %s could not be loaded (%s): using the projection instead", folder, exc)
    if plan[0] == "channels":
        vae_cfg = pipeline.preview_vae_config() if hasattr(pipeline, "preview_vae_config") else {}
        try:
            proj, where = find_projection(type(pipeline), getattr(pipeline, "omni_model_path", None), channels,
                                          vae_cfg)
        except Exception as exc:  # noqa: BLE001
            proj, where = None, str(exc)
        if proj is not None:
            plan = ("projection", proj)
            logger.debug("previews of %s: projection from %s", type(pipeline).__name__, where)
        else:
            logger.info("previews of %s: latent channels min-max scaled (%s)", type(pipeline).__name__, where)
    cache[channels] = plan
    return plan


def preview_source(pipeline: Any, state: Any) -> Any:
    """``pipeline.preview_latents`` of the step's clean estimate (the current latents before the first step or
    when the scheduler is not flow matching): ``[C, h, w]`` or ``[C, F, h, w]``, on the model's device."""
    from omni_core.pipelines.state import flow_clean_estimate

    x0 = flow_clean_estimate(state)
    if x0 is not None and tuple(x0.shape) == tuple(state.latents.shape):
        state = attrs.evolve(state, latents=x0.to(state.latents.dtype))
    return pipeline.preview_latents(state)


def render_latents(pipeline: Any, latents: Any) -> Any:
    """Preview latents (``[C, h, w]`` or ``[C, F, h, w]``) -> ``[3, h', w']`` in [0, 1] on the CPU, by the
    pipeline's plan (tiny decoder, projection or channels)."""
    kind, how = _preview_plan(pipeline, int(latents.shape[0]))
    if kind == "channels":
        return channel_preview(latents)
    frames = preview_frames_of(latents, how)
    return tile_frames(frames).cpu()


def preview_frames_of(latents: Any, how: Any) -> Any:
    """``[k, 3, h, w]``: the (up to four) frames a preview shows, each through ``how`` (a projection or
    a tiny decoder)."""
    import torch

    if latents.dim() == 3:
        picks = [latents]
    else:
        picks = [latents[:, i] for i in frame_indices(latents.shape[1])]
    fn = how.decode if isinstance(how, TinyDecoder) else how.apply
    return torch.stack([fn(p) for p in picks])


def render_preview(pipeline: Any, state: Any) -> Any:
    """The preview of ``state`` (see the module docstring); None before there are latents."""
    import torch

    if state.latents is None:
        return None
    with torch.no_grad():
        return render_latents(pipeline, preview_source(pipeline, state))


def preview_frames(pipeline: Any, state: Any) -> Any:
    """The frames of a (video) preview as ``[k, 3, h, w]`` (an image: ``k = 1``), for callers that want them
    apart rather than tiled."""
    import torch

    with torch.no_grad():
        lat = preview_source(pipeline, state)
        kind, how = _preview_plan(pipeline, int(lat.shape[0]))
        if kind == "channels":
            return channel_preview(lat)[None]
        return preview_frames_of(lat, how).cpu()


__all__ = ["LatentProjection", "PROJECTION_FILE", "TinyDecoder", "channel_preview", "declared_projections",
           "find_projection", "frame_indices", "preview_frames", "preview_source", "read_projection",
           "render_latents", "render_preview", "tile_frames", "vae_config_of", "write_projection"]
