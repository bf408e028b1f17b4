"""What a diffusers folder says about its pipeline, read from its JSON files alone (no torch, no diffusers).

The engine's process refuses a size before it loads anything (``PipelineSpec.size_rules``), so the rules a
generic pipeline follows come from the folder: the VAE's spatial (and temporal) compression and the denoiser's
patch size. Diffusers' own pipelines check ``height % (vae_scale_factor * 2)`` for their packed or patched DiTs
and ``% vae_scale_factor`` for UNets; the rule here is that one, so whatever passes here passes there.
"""

from __future__ import annotations

import math
import os

from omni_core.utils.diffusers_folder import read_json, read_model_index

#: the denoiser components diffusers pipelines name, in the order they are looked for
DENOISERS = ("transformer", "unet", "prior", "decoder")


def component_config(model_path: str, component: str) -> dict:
    return read_json(os.path.join(model_path, component, "config.json")) or {}


def denoiser_of(model_path: str) -> str | None:
    """The folder's denoiser component (``transformer``, ``unet``, ...), or None."""
    index = read_model_index(model_path) or {}
    for name in DENOISERS:
        value = index.get(name)
        if isinstance(value, list) and value[0] is not None:
            return name
    return None


def vae_scales(model_path: str) -> tuple[int, int]:
    """(spatial, temporal) compression of the folder's VAE; (8, 1) when it has none we can read."""
    vae = component_config(model_path, "vae")
    if "temperal_downsample" in vae:  # Wan's VAE (diffusers' spelling)
        flags = vae["temperal_downsample"]
        return 2 ** len(flags), 2 ** sum(bool(f) for f in flags)
    spatial = vae.get("spatial_compression_ratio")
    if spatial is None and vae.get("block_out_channels"):
        spatial = 2 ** (len(vae["block_out_channels"]) - 1)
    temporal = vae.get("temporal_compression_ratio") or 1
    return int(spatial or 8), int(temporal)


def patch_size(model_path: str, denoiser: str | None) -> int:
    """The denoiser's spatial patch size (1 for a UNet)."""
    if denoiser is None:
        return 1
    value = component_config(model_path, denoiser).get("patch_size") or 1
    return int(value[-1] if isinstance(value, (list, tuple)) else value)


def packs_latents(model_path: str, denoiser: str | None) -> bool:
    """The transformer takes 2x2 latent patches packed into channels (FLUX, Qwen-Image: ``in_channels`` is four
    times the VAE's ``latent_channels``), so sizes must be even in latents."""
    if denoiser != "transformer":
        return False
    latent = component_config(model_path, "vae").get("latent_channels") or component_config(
        model_path, "vae").get("z_dim")
    return bool(latent) and component_config(model_path, denoiser).get("in_channels") == 4 * latent


def size_rules(model_path: str) -> tuple[int, int, int]:
    """(height multiple, width multiple, frame multiple) of the folder's pipeline: the VAE's factor times the
    transformer's patch size, or 2 where it packs latents; a UNet pipeline's at least 8 (Stable Diffusion's
    ``check_inputs`` asks for 8 whatever the VAE); and the VAE's temporal factor."""
    denoiser = denoiser_of(model_path)
    spatial, temporal = vae_scales(model_path)
    if denoiser == "transformer":
        multiple = spatial * (2 if packs_latents(model_path, denoiser) else patch_size(model_path, denoiser))
    else:
        multiple = math.lcm(8, spatial)
    return multiple, multiple, temporal


def default_side(model_path: str) -> int:
    """The side of the pipeline's default output when its call has no default: the denoiser's ``sample_size``
    times the VAE's factor (diffusers' ``default_sample_size * vae_scale_factor``; 128 for DiTs without one)."""
    denoiser = denoiser_of(model_path)
    spatial, _ = vae_scales(model_path)
    sample = component_config(model_path, denoiser).get("sample_size") if denoiser else None
    if isinstance(sample, (list, tuple)):
        sample = sample[0]
    return int(sample or 128) * spatial


__all__ = ["default_side", "denoiser_of", "size_rules", "vae_scales"]
