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
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from typing import Any, Iterable

import attrs

#: the file in a model folder that holds its fitted projection (``omni preview calibrate --write``)
PROJECTION_FILE = "preview_projection.json"
#: frames a video preview shows (tiled 2x2)
VIDEO_PREVIEW_FRAMES = 4

logger = logging.getLogger(__name__)


def _nested_floats(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_nested_floats(v) for v in value)
    return float(value)


@attrs.frozen(cache_hash=True)
class LatentProjection:
    """A linear latent-to-RGB map: ``rgb = weight @ latent + bias`` per latent pixel (``weight`` ``3 x C``, the
    form published latent-RGB factors take), or, with ``weight`` ``3 x C x k x k`` (odd ``k``), the same over
    each pixel's ``k x k`` neighbourhood (a linear convolution, edges replicated): for VAEs whose decode of a
    pixel depends on its neighbours more than on itself (tiny random ones). Output clamped to [0, 1]."""

    weight: tuple = attrs.field(converter=_nested_floats)
    bias: tuple = attrs.field(converter=_nested_floats)
    #: where it came from (a citation, or "fitted: ..." with the fit's numbers)
    source: str = ""

    def __attrs_post_init__(self) -> None:
        import torch

        try:
            w = torch.tensor(self.weight)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a preview projection's weight is a 3 x C or 3 x C x k x k array: {exc}") from None
        if (w.dim() not in (2, 4) or w.shape[0] != 3 or w.shape[1] == 0 or len(self.bias) != 3
                or (w.dim() == 4 and (w.shape[2] != w.shape[3] or w.shape[2] % 2 == 0))):
            raise ValueError(f"a preview projection is a 3 x C (or 3 x C x k x k, k odd) weight and 3 biases, got "
                             f"{tuple(w.shape)} and {len(self.bias)} biases")

    @property
    def channels(self) -> int:
        return len(self.weight[0])

    @property
    def kernel(self) -> int:
        """The neighbourhood size ``k`` (1: a plain ``3 x C`` matrix)."""
        first = self.weight[0][0]
        return len(first) if isinstance(first, tuple) else 1

    def apply(self, latents: Any) -> Any:
        """``[C, h, w]`` (or ``[C, F, h, w]``) latents -> ``[3, h, w]`` (``[3, F, h, w]``) float32 RGB in [0, 1]
        on the latents' device."""
        import torch
        import torch.nn.functional as F

        lat = latents.float()
        w, b = _projection_tensors(self, lat.device)
        if self.kernel == 1:
            out = torch.einsum("oc,c...->o...", w, lat) + b.view(3, *([1] * (lat.dim() - 1)))
            return out.clamp(0, 1)
        frames = lat.transpose(0, 1) if lat.dim() == 4 else lat[None]  # [N, C, h, w]
        k = self.kernel // 2
        out = F.conv2d(F.pad(frames, (k, k, k, k), mode="replicate"), w, b)
        out = out.transpose(0, 1) if lat.dim() == 4 else out[0]
        return out.clamp(0, 1)

    def to_json(self) -> dict:
        def lists(v: Any) -> Any:
            return [lists(x) for x in v] if isinstance(v, tuple) else v

        return {"weight": lists(self.weight), "bias": list(self.bias), "source": self.source}

    @classmethod
    def from_json(cls, data: dict) -> LatentProjection:
        return cls(data["weight"], data["bias"], data.get("source", ""))

    @classmethod
    def from_comfy_factors(cls, factors: list, bias: list, source: str = "") -> LatentProjection:
        """ComfyUI-style ``latent_rgb_factors`` (``C x 3``, output in [-1, 1]) and ``latent_rgb_factors_bias``
        -> a projection to [0, 1]: ``W = F^T / 2``, ``b = (bias + 1) / 2``."""
        return cls([[f[o] / 2 for f in factors] for o in range(3)], [(v + 1) / 2 for v in bias], source)


@functools.lru_cache(maxsize=32)
def _projection_tensors(projection: LatentProjection, device: Any) -> tuple:
    """The weight and bias as float32 tensors on ``device``, made once (previews run every step)."""
    import torch

    return (torch.tensor(projection.weight, dtype=torch.float32, device=device),
            torch.tensor(projection.bias, dtype=torch.float32, device=device))


# --------------------------------------------------------------------------------------------- reading / writing
def read_projection(path: str) -> LatentProjection:
    """A model folder's ``preview_projection.json``; a malformed file is a ConfigError naming it."""
    from omni_core.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            return LatentProjection.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a preview projection ({{\"weight\": 3 x C, \"bias\": 3}}): {exc}",
                          field="preview_projection") from None


def write_projection(model_path: str, projection: LatentProjection, **meta: Any) -> str:
    """Store ``projection`` (plus ``meta``, e.g. the fit's PSNR) as ``<model_path>/preview_projection.json``."""
    path = os.path.join(model_path, PROJECTION_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**projection.to_json(), **meta}, f, indent=2)
        f.write("\n")
    return path


def declared_projections(pipeline_cls: type) -> list[dict]:
    """The entries of the JSON resource a pipeline class declares in ``preview_projections``
    (``"package:file.json"``), each ``{"match": {vae config key: value}, "weight", "bias", "source"}``."""
    ref = getattr(pipeline_cls, "preview_projections", None)
    if not ref:
        return []
    from importlib import resources

    package, _, name = ref.partition(":")
    data = json.loads(resources.files(package).joinpath(name).read_text(encoding="utf-8"))
    return list(data.get("projections", []))


def _matches(match: dict, vae_config: dict) -> bool:
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, float) or isinstance(b, float):
            return isinstance(b, (int, float)) and isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-4)
        return a == b

    return all(key in vae_config and same(value, vae_config[key]) for key, value in match.items())


def find_projection(pipeline_cls: type, model_path: str | None, channels: int,
                    vae_config: dict | None = None) -> tuple[LatentProjection | None, str]:
    """The projection for ``channels``-channel latents and where it came from: the model folder's
    ``preview_projection.json`` first, then the first shipped entry whose ``match`` holds for ``vae_config``
    (the VAE's config.json plus ``_class_name``); ``(None, reason)`` when there is none."""
    if model_path and os.path.isfile(os.path.join(model_path, PROJECTION_FILE)):
        proj = read_projection(os.path.join(model_path, PROJECTION_FILE))
        if proj.channels == channels:
            return proj, os.path.join(model_path, PROJECTION_FILE)
        logger.warning("%s is for %d latent channels, the model has %d; not used",
                       os.path.join(model_path, PROJECTION_FILE), proj.channels, channels)
    for entry in declared_projections(pipeline_cls):
        proj = LatentProjection.from_json(entry)
        if proj.channels == channels and _matches(entry.get("match", {}), vae_config or {}):
            return proj, f"{pipeline_cls.preview_projections} ({proj.source})"
    return None, (f"no {PROJECTION_FILE} in the model folder and no shipped projection for this VAE "
                  f"(omni preview calibrate --model M --write fits one)")


def vae_config_of(vae: Any) -> dict:
    """A diffusers VAE's config as a plain dict with ``_class_name`` (what shipped projections match)."""
    if vae is None:
        return {}
    return {**dict(getattr(vae, "config", {}) or {}), "_class_name": type(vae).__name__}


# --------------------------------------------------------------------------------------------- rendering
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


# --------------------------------------------------------------------------------------------- fitting
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


__all__ = ["LatentProjection", "PROJECTION_FILE", "TinyDecoder", "channel_preview", "choose_kernel", "collect_pairs",
           "declared_projections", "find_projection", "fit_projection", "frame_indices", "pool_target",
           "preview_frames", "preview_source", "projection_psnr", "psnr", "read_projection", "render_latents",
           "render_preview", "target_image", "tile_frames", "vae_config_of", "write_projection"]
