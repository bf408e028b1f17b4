"""Preview projections: a per-model linear latent-to-RGB map (:class:`LatentProjection`), where a model's comes
from (its folder's ``preview_projection.json``, else the entries its plugin ships, matched on the VAE's config),
and reading and writing it. Rendering with it is :mod:`omni_core.pipelines.preview`; fitting it,
:mod:`omni_core.pipelines.preview_fit`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from typing import Any

import attrs

#: the file in a model folder that holds its fitted projection (``omni preview calibrate --write``)
PROJECTION_FILE = "preview_projection.json"

logger = logging.getLogger("omni_core.pipelines.preview")


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


__all__ = ["LatentProjection", "PROJECTION_FILE", "declared_projections", "find_projection", "read_projection",
           "vae_config_of", "write_projection"]
