"""Fitting a preview projection: (clean-estimate latents, VAE decode pooled to the latent grid) pairs from runs
of the model itself (:func:`collect_pairs`), least squares over them (:func:`fit_projection`), the neighbourhood
size chosen on held-out prompts (:func:`choose_kernel`) and PSNR to score it. Used by ``omni preview calibrate``,
the previews bench and the preview tests; the engine never imports it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import attrs

from omni_core.pipelines.preview import frame_indices, tile_frames
from omni_core.pipelines.preview_projection import LatentProjection


def pool_target(decoded: Any, latents: Any) -> Any:
    """The VAE decode of a clean estimate, area-averaged to the latent grid of ``latents``: an image
    ``[3, H, W]`` -> ``[3, h, w]``; a video ``[F_px, 3, H, W]`` with ``[C, F, h, w]`` latents -> ``[3, F, h, w]``,
    latent frame 0 = pixel frame 0 and frame i >= 1 the mean of its ``t`` pixel frames (causal temporal
    compression, ``F_px = 1 + (F - 1) t``)."""
    import torch
    import torch.nn.functional as F

    h, w = latents.shape[-2:]
    if latents.dim() == 3:
        img = decoded[0] if decoded.dim() == 4 else decoded
        return F.adaptive_avg_pool2d(img.float()[None], (h, w))[0]
    frames = decoded.float()  # [F_px, 3, H, W]
    n = latents.shape[1]
    t = max(1, (frames.shape[0] - 1) // max(1, n - 1)) if n > 1 else 1
    pooled = F.adaptive_avg_pool2d(frames, (h, w))  # [F_px, 3, h, w]
    groups = [pooled[:1]] + [pooled[1 + (i - 1) * t: 1 + i * t] for i in range(1, n)]
    return torch.stack([g.mean(0) if len(g) else pooled[-1] for g in groups], dim=1)


def _patches(latents: Any, kernel: int) -> Any:
    """``[C, h, w]`` / ``[C, F, h, w]`` -> ``[pixels, C * k * k]`` float64 neighbourhoods (edges replicated), in
    the order :meth:`LatentProjection.apply` weighs them."""
    import torch.nn.functional as F

    lat = latents.detach().float().cpu()
    frames = lat.transpose(0, 1) if lat.dim() == 4 else lat[None]
    if kernel > 1:
        k = kernel // 2
        frames = F.unfold(F.pad(frames, (k, k, k, k), mode="replicate"), kernel)  # [N, C*k*k, h*w]
    else:
        frames = frames.flatten(2)
    return frames.transpose(1, 2).reshape(-1, frames.shape[1]).double()


def _pixels(target: Any) -> Any:
    """``[3, h, w]`` / ``[3, F, h, w]`` -> ``[pixels, 3]`` float64, in :func:`_patches`' order."""
    t = target.detach().float().cpu()
    frames = t.transpose(0, 1) if t.dim() == 4 else t[None]
    return frames.flatten(2).transpose(1, 2).reshape(-1, 3).double()


def fit_projection(pairs: Iterable[tuple[Any, Any]], kernel: int = 1, ridge: float = 1e-4,
                   source: str = "") -> LatentProjection:
    """Least squares ``rgb ~ W @ latent + b`` over every latent pixel of ``pairs`` ((preview latents, pooled
    decode) as :func:`pool_target` gives), over ``kernel x kernel`` neighbourhoods when ``kernel > 1``, with a
    small ridge (relative to the features' variance) so constant channels do not blow up. The normal equations
    are summed pair by pair, so memory does not grow with the number of pairs."""
    import torch

    sxx = sx = sxy = sy = None
    n = 0
    channels = None
    for lat, target in pairs:
        channels = lat.shape[0]
        x, y = _patches(lat, kernel), _pixels(target)
        if sxx is None:
            sxx, sx = x.T @ x, x.sum(0)
            sxy, sy = x.T @ y, y.sum(0)
        else:
            sxx += x.T @ x
            sx += x.sum(0)
            sxy += x.T @ y
            sy += y.sum(0)
        n += len(x)
    if not n:
        raise ValueError("no (latents, decode) pairs to fit a preview projection on")
    mx, my = sx / n, sy / n
    cov = sxx - n * torch.outer(mx, mx)
    reg = ridge * float(torch.diagonal(cov).mean().clamp_min(1e-12))
    w = torch.linalg.solve(cov + reg * torch.eye(len(mx), dtype=cov.dtype), sxy - n * torch.outer(mx, my)).T
    b = my - w @ mx
    if kernel > 1:
        w = w.reshape(3, channels, kernel, kernel)
    return LatentProjection(w.tolist(), b.tolist(), source)


def choose_kernel(records: list[dict], kernels: tuple[int, ...] = (1, 3, 5), gain_db: float = 0.5
                  ) -> tuple[int, dict[int, float]]:
    """The neighbourhood size to fit with: each of ``kernels`` fitted on the records of half the prompts and
    scored (mean PSNR) on the other half; a larger one is chosen only if it is at least ``gain_db`` better than
    the best smaller one (a plain ``3 x C`` matrix when it does as well). Returns the choice and the scores."""
    prompts = sorted({(r["prompt"], r["seed"]) for r in records})
    held = set(prompts[len(prompts) // 2:]) if len(prompts) > 1 else set()
    fit_on = [r for r in records if (r["prompt"], r["seed"]) not in held] or records
    score_on = [r for r in records if (r["prompt"], r["seed"]) in held] or records
    scores: dict[int, float] = {}
    best = None
    for k in kernels:
        proj = fit_projection(((r["latents"], r["target"]) for r in fit_on), kernel=k)
        scores[k] = projection_psnr(proj, score_on)
        if best is None or scores[k] >= scores[best] + gain_db:
            best = k
    return best, scores


def psnr(a: Any, b: Any) -> float:
    """PSNR in dB of two images in [0, 1] of one shape."""
    mse = float(((a.float().cpu() - b.float().cpu()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def collect_pairs(pipeline: Any, prompts: list[str], *, model_path: str | None = None, steps: int | None = None,
                  seed: int = 0, at: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0), sampling: dict | None = None,
                  on_state: Any = None) -> list[dict]:
    """Run each prompt through ``pipeline`` (step by step, one request at a time) and, after the steps at the
    fractions ``at`` of the run, record the step's clean estimate: ``{"step", "num_steps", "prompt", "seed",
    "latents"`` (preview latents of x0), ``"current"`` (preview latents of the noisy latents),
    ``"decoded"`` (the VAE decode of x0 as the final output would be), ``"target"`` (it pooled to the latent
    grid)}``. ``on_state(record, state)`` may add fields (the bench adds today's preview)."""
    import torch

    from omni_core.config import SamplingParams
    from omni_core.pipelines.state import StepState, flow_clean_estimate
    from omni_core.request import OmniDiffusionRequest

    records: list[dict] = []
    for k, prompt in enumerate(prompts):
        params = SamplingParams(num_inference_steps=steps, seed=seed + k,
                                **{key: v for key, v in (sampling or {}).items() if v is not None})
        params = type(pipeline).check_sampling_params(params, model_path)
        req = OmniDiffusionRequest(prompt=prompt, sampling_params=params)
        gen = torch.Generator(device=getattr(pipeline, "device", "cpu")).manual_seed(params.seed)
        state = StepState(request=req, generator=gen)
        with torch.inference_mode():
            with pipeline.encoded_prompts([state]):
                pipeline.prepare_encode(state)
            n = state.num_steps
            wanted = sorted({min(n, max(1, round(f * n))) for f in at})
            while not state.done:
                (pred,) = pipeline.denoise_step([state])
                pipeline.step_scheduler(state, pred)
                if state.step_index not in wanted:
                    continue
                x0 = flow_clean_estimate(state)
                if x0 is None:
                    raise RuntimeError(f"{type(pipeline).__name__} keeps no clean estimate (remember_flow_step in "
                                       "its step_scheduler): previews have nothing to fit against")
                clean = attrs.evolve(state, latents=x0.to(state.latents.dtype))
                (out,) = pipeline.post_decode_batch([clean])
                decoded = out.tensor[0].float().cpu()  # [3, H, W] or [F, 3, H, W]
                lat = pipeline.preview_latents(clean).float().cpu()
                rec = {"prompt": prompt, "seed": params.seed, "step": state.step_index, "num_steps": n,
                       "latents": lat, "current": pipeline.preview_latents(state).float().cpu(),
                       "decoded": decoded, "target": pool_target(decoded, lat)}
                if on_state is not None:
                    on_state(rec, state)
                records.append(rec)
    return records


def projection_psnr(projection: LatentProjection, records: list[dict]) -> float:
    """Mean PSNR of the projection's preview against the pooled decode over ``records``."""
    return sum(psnr(projection.apply(r["latents"]), r["target"]) for r in records) / max(1, len(records))


def target_image(record: dict) -> Any:
    """The pooled decode of a record as the preview shows it (a video: its frames tiled like the preview)."""
    target, lat = record["target"], record["latents"]
    if lat.dim() == 3:
        return target
    return tile_frames(target[:, frame_indices(lat.shape[1])].permute(1, 0, 2, 3))


__all__ = ["choose_kernel", "collect_pairs", "fit_projection", "pool_target", "projection_psnr", "psnr",
           "target_image"]
