"""FLUX.2's size rules, read from a folder's JSON without importing torch (the record's ``size_rules`` and the
pipelines' own check)."""

from omni_core.pipelines.shape_check import folder_config


def vae_scale_factor(model_path: str | None) -> int:
    """diffusers: ``2 ** (len(vae.block_out_channels) - 1)`` (8 for the released FLUX.2 VAE); 8 when unknown."""
    cfg = folder_config(model_path, "vae")
    return 2 ** (len(cfg["block_out_channels"]) - 1) if cfg and "block_out_channels" in cfg else 8


def size_rules(model_path: str | None) -> tuple[int, int, int]:
    """Height and width multiples of vae_scale_factor * 2 (the VAE's 2x2 patchify); no frames."""
    m = vae_scale_factor(model_path) * 2
    return m, m, 1
