"""Preview fidelity checks a model plugin's tests share (issue #37: previews that look like the picture).

:func:`check_preview_projection` calibrates a loaded pipeline on a few short runs, then on other prompts and
seeds compares, at the middle step, the old channel preview and the projection's preview with the VAE decode of
the step's clean estimate, and checks that ``pipeline.preview`` really uses a folder's
``preview_projection.json`` (a video: four frames tiled 2x2). ``bench/previews.py`` is the full-size version.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def check_preview_projection(pipeline: Any, *, sampling: dict | None = None, steps: int = 4, calib: int = 3,
                             evals: int = 2, min_margin_db: float = 6.0) -> dict:
    """Assert the fitted projection beats the channel preview by ``min_margin_db`` and that ``preview`` uses
    it; returns the numbers (``channel``, ``projection``, ``kernel``)."""
    import torch

    from omni_core.pipelines.preview import (PROJECTION_FILE, channel_preview, frame_indices, tile_frames,
                                             write_projection)
    from omni_core.pipelines.preview_fit import choose_kernel, collect_pairs, fit_projection, projection_psnr, psnr
    from omni_core.pipelines.state import StepState
    from omni_core.request import OmniDiffusionRequest

    prompts = list(type(pipeline).example_prompts())
    cal = collect_pairs(pipeline, prompts[:calib], steps=steps, seed=0, sampling=sampling)
    kernel, _ = choose_kernel(cal)
    proj = fit_projection(((r["latents"], r["target"]) for r in cal), kernel=kernel)
    ev = collect_pairs(pipeline, prompts[calib:calib + evals], steps=steps, seed=1000, at=(0.5,), sampling=sampling)

    def middle(t: Any) -> Any:
        return t[:, t.shape[1] // 2] if t.dim() == 4 else t

    channel = sum(psnr(channel_preview(r["current"]), middle(r["target"])) for r in ev) / len(ev)
    projected = projection_psnr(proj, ev)
    numbers = {"channel": channel, "projection": projected, "kernel": kernel}
    assert projected >= channel + min_margin_db, (
        f"{type(pipeline).__name__}: the projection's preview is {projected:.1f} dB against the decode of the "
        f"clean estimate, the channel preview {channel:.1f} dB; at least {min_margin_db} dB better expected")

    # pipeline.preview of a mid-run state uses the folder's projection (cache of found projections reset)
    saved = {k: pipeline.__dict__.get(k) for k in ("omni_model_path", "_omni_preview_plans")}
    with tempfile.TemporaryDirectory() as folder:
        write_projection(folder, proj)
        assert os.path.isfile(os.path.join(folder, PROJECTION_FILE))
        pipeline.__dict__["omni_model_path"] = folder
        pipeline.__dict__.pop("_omni_preview_plans", None)
        try:
            from omni_core.config import SamplingParams

            params = type(pipeline).check_sampling_params(
                SamplingParams(num_inference_steps=steps, seed=7, **{k: v for k, v in (sampling or {}).items()
                                                                     if v is not None}), None)
            state = StepState(request=OmniDiffusionRequest(prompt=prompts[0], sampling_params=params),
                              generator=torch.Generator(device=getattr(pipeline, "device", "cpu")).manual_seed(7))
            with torch.inference_mode():
                with pipeline.encoded_prompts([state]):
                    pipeline.prepare_encode(state)
                (pred,) = pipeline.denoise_step([state])
                pipeline.step_scheduler(state, pred)
                shown = pipeline.preview(state)
                from omni_core.pipelines.preview import preview_source

                lat = preview_source(pipeline, state)
            want = proj.apply(lat)
            if want.dim() == 4:  # a video: its frames tiled 2x2
                want = tile_frames(want[:, frame_indices(want.shape[1])].permute(1, 0, 2, 3))
            assert shown.dim() == 3 and shown.shape[0] == 3
            assert torch.allclose(shown, want.cpu(), atol=1e-5), "preview() does not use the folder's projection"
        finally:
            for key, value in saved.items():
                if value is None:
                    pipeline.__dict__.pop(key, None)
                else:
                    pipeline.__dict__[key] = value
    return numbers


def check_shipped_projections(pipeline: Any, *, expect_match: bool = False) -> list:
    """Every projection the pipeline's class ships parses (``3 x C`` weights, a ``match``), and one matches this
    pipeline's VAE exactly when ``expect_match`` (tiny random VAEs must match none: published factors are not
    for them). Returns the parsed projections."""
    from omni_core.pipelines.preview import LatentProjection, declared_projections, find_projection

    entries = declared_projections(type(pipeline))
    assert entries, f"{type(pipeline).__name__} ships no preview projections (preview_projections)"
    parsed = [LatentProjection.from_json(e) for e in entries]
    assert all("match" in e for e in entries)
    vae = pipeline.preview_vae_config() if hasattr(pipeline, "preview_vae_config") else {}
    found = [find_projection(type(pipeline), None, p.channels, vae)[0] is not None for p in parsed]
    assert any(found) == expect_match, (f"{type(pipeline).__name__}: a shipped projection matches this VAE: "
                                        f"{found}; expected {'one' if expect_match else 'none'}")
    return parsed


__all__ = ["check_preview_projection", "check_shipped_projections"]
