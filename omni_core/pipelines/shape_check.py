"""Checks of a request that need no model: run before the model loads (``omni generate``, ``omni serve``).

What a pipeline's record states (``PipelineSpec.is_video``, ``size_multiple``, ``frame_multiple``, ``size_rules``)
and the core's own field checks (``SamplingParams``) are enough to refuse ``--height 30`` at once, instead of
after the seconds that importing torch and loading the weights take. The pipeline's ``check_sampling_params``
still runs on every request (it knows more: limits, the folder's other configs); the two agree because they
read the same rules. Imports nothing heavy.
"""

from __future__ import annotations

import os
from typing import Any

from omni_core.errors import ConfigError
from omni_core.pipelines.diffusers_folder import read_json
from omni_core.plugins.types import PipelineSpec, resolve_impl


def folder_config(model_path: str | None, component: str) -> dict | None:
    """``<model_path>/<component>/config.json`` as a dict; None without a folder or file (for ``size_rules``)."""
    return read_json(os.path.join(model_path, component, "config.json")) if model_path else None


def shape_rules(spec: PipelineSpec, model_path: str | None) -> tuple[int | None, int | None, int | None]:
    """``(height multiple, width multiple, frame multiple)`` of this record and folder; None where the record
    does not say (nothing is checked early for that field)."""
    if spec.size_rules:
        height, width, frames = resolve_impl(spec.size_rules)(model_path)
        return int(height), int(width), int(frames) if spec.is_video else None
    return spec.size_multiple, spec.size_multiple, spec.frame_multiple if spec.is_video else None


def check_shape(spec: PipelineSpec, model_path: str | None, *, height: int | None = None, width: int | None = None,
                num_frames: int | None = None, names: dict[str, str] | None = None) -> None:
    """Refuse, with a :class:`ConfigError` naming the field, a height, width or frame count that the record's
    rules forbid. ``names``: how the caller's user spells each field (``{"height": "--height"}``)."""
    names = names or {}
    hm, wm, fm = shape_rules(spec, model_path)
    for field, value, m in (("height", height, hm), ("width", width, wm)):
        if value is not None and m and value % m:
            lo, hi = value // m * m, (value // m + 1) * m
            raise ConfigError(f"{names.get(field, field)} {value} is not allowed for {spec.name}: height must be a "
                              f"multiple of {hm} and width a multiple of {wm} (e.g. {lo or m} or {hi})"
                              if hm != wm else
                              f"{names.get(field, field)} {value} is not allowed for {spec.name}: it must be a "
                              f"multiple of {m} (e.g. {lo or m} or {hi})", field=field)
    if num_frames is None:
        return
    label = names.get("num_frames", "num_frames")
    if spec.is_video is False and num_frames != 1:
        raise ConfigError(f"{label} {num_frames} is not allowed: {spec.name} makes images (leave it unset or 1)",
                          field="num_frames")
    # a count off the frame multiple is the pipeline's to round (diffusers' and vLLM-Omni's Wan round it with a
    # warning: round_frames) or to refuse after loading; nothing to refuse here


def round_frames(num_frames: int, frame_multiple: int) -> int:
    """The frame count a video model with ``num_frames - 1`` a multiple of ``frame_multiple`` makes for
    ``num_frames``: diffusers' rounding (``WanPipeline.__call__``: ``n // m * m + 1``, 32 -> 33, 35 -> 33), which
    vLLM-Omni's Wan pipelines use too, so a client's count means the same video here as there."""
    if frame_multiple <= 1 or (num_frames - 1) % frame_multiple == 0:
        return num_frames
    return num_frames // frame_multiple * frame_multiple + 1


def check_before_loading(model: str, sampling: dict[str, Any] | None = None,
                         names: dict[str, str] | None = None, pipeline: str | None = None) -> Any:
    """Everything about ``model`` and a request's ``sampling`` keywords that can be checked without the model:
    the model name or folder resolves to an installed pipeline, the core fields are valid (``SamplingParams``),
    and height, width and frames follow the record's rules. Returns the ``ResolvedModel``."""
    from omni_core.config import SamplingParams
    from omni_core.pipelines.loader import resolve_model

    resolved = resolve_model(model, pipeline=pipeline)
    if sampling:
        try:
            params = SamplingParams.from_kwargs(**sampling)
        except ConfigError as exc:
            if names and exc.field in names:  # the user's spelling of the field, not SamplingParams'
                raise ConfigError(str(exc).replace(f"SamplingParams.{exc.field}=", f"{names[exc.field]} "),
                                  field=exc.field) from None
            raise
        check_shape(resolved.spec, resolved.model_path, height=params.height, width=params.width,
                    num_frames=params.num_frames, names=names)
    return resolved
