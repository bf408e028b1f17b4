"""The shapes a PixArt-Sigma folder takes, read from its JSON configs (no torch): the record's ``size_rules``
(checked before the model loads) and the pipeline's own check call the same functions, so they never disagree."""

from __future__ import annotations

from omni_core.pipelines.shape_check import folder_config

#: the released PixArt-Sigma 1024 folders: VAE factor 8, 2x2 patches, sample_size 128 (1024 px)
DEFAULT_VAE_FACTOR, DEFAULT_PATCH, DEFAULT_SAMPLE_SIZE = 8, 2, 128


def vae_scale_factor(model_path: str | None) -> int:
    """diffusers' ``2 ** (len(vae.config.block_out_channels) - 1)``."""
    cfg = folder_config(model_path, "vae") or {}
    channels = cfg.get("block_out_channels")
    return 2 ** (len(channels) - 1) if channels else DEFAULT_VAE_FACTOR


def size_rules(model_path: str | None) -> tuple[int, int, int]:
    """``(height multiple, width multiple, frame multiple)``: the latent must split into whole patches."""
    patch = (folder_config(model_path, "transformer") or {}).get("patch_size") or DEFAULT_PATCH
    m = vae_scale_factor(model_path) * patch
    return m, m, 1


def default_size(model_path: str | None) -> tuple[int, int]:
    """diffusers' default: ``transformer.config.sample_size * vae_scale_factor`` on both sides."""
    sample = (folder_config(model_path, "transformer") or {}).get("sample_size") or DEFAULT_SAMPLE_SIZE
    side = sample * vae_scale_factor(model_path)
    return side, side
