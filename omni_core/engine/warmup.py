"""The start-up warm-up: one tiny request end to end before the first user request, so that one is not the slow one.

A failure names the model, the shape, where it was raised and how to start without it.
"""

from __future__ import annotations

import secrets
from typing import Any

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError, OmniError
from omni_core.request import OmniDiffusionRequest
from omni_core.utils.progress import progress
from omni_core.utils.tracebacks import innermost_frame



def warmup_params(pipeline_cls: Any, model_path: str) -> SamplingParams:
    """One step at the smallest valid shape (not the model's default size, which costs a full-size step
    and may not fit a small model), or the pipeline's own ``warmup_params`` (a class attribute dict)."""
    hm, wm, _ = pipeline_cls.size_multiples(model_path)
    values: dict[str, Any] = {"height": hm, "width": wm, "num_inference_steps": 1, "output_type": "latent", "seed": 0}
    if pipeline_cls.is_video:
        values["num_frames"] = 1  # (num_frames - 1) % frame_multiple == 0 holds for any multiple
    declared = getattr(pipeline_cls, "warmup_params", None)
    params = SamplingParams.from_kwargs(**{**values, **(declared or {})})
    for _ in range(3):  # a folder may need a larger multiple than the class declares (e.g. a VAE factor)
        try:
            return pipeline_cls.check_sampling_params(params, model_path)
        except ConfigError as exc:
            if declared or exc.field not in ("height", "width"):
                raise
            params = params.replace(height=params.height * 2, width=params.width * 2)
    return pipeline_cls.check_sampling_params(params, model_path)


def run_startup_warmup(engine: Any) -> None:
    """Run one tiny request through ``engine``; raises ``OmniError`` saying which model, shape and where."""
    cls, shape, frame = engine.pipeline_cls, "(no shape: choosing it failed)", None
    try:
        params = engine.warmup_params()
        shape = (f"height={params.height} width={params.width}"
                 + (f" num_frames={params.num_frames}" if params.num_frames is not None else "")
                 + f" steps={params.num_inference_steps}")
        progress(f"model loaded; warming up ({shape}) ...")
        req = OmniDiffusionRequest(prompt="warmup", sampling_params=params, request_id=f"warmup-{secrets.token_hex(4)}")
        if cls.image_input is not None:  # a model that needs input images warms up with grey ones
            from omni_core.images import warmup_images

            req.images = warmup_images(cls.image_input, params.height, params.width)
            cls.check_images(req, engine.limits)
        out = engine.admit([req])[0].result()
        error, frame = out.error, out.metrics.get("error_frame")
    except Exception as exc:  # noqa: BLE001 - the shape was refused, or the engine died
        out, error, frame = None, f"{type(exc).__name__}: {exc}", innermost_frame(exc)
    if out is None or out.status == "error":
        resolved = engine.resolved
        raise OmniError(f"start-up warmup of model {resolved.spec.name!r} ({resolved.model_path}) failed "
                        f"at {shape}: {error}" + (f" [raised at {frame}]" if frame else "")
                        + "; start without it with warmup=False (omni serve / omni generate --no-warmup)")


__all__ = ["run_startup_warmup", "warmup_params"]
