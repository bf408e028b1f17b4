"""Z-Image's own sampling fields (diffusers' ``cfg_normalization`` and ``cfg_truncation``), declared once: on the
``PipelineSpec`` record (``hooks``) and the pipeline class. Imports nothing heavy. Both are applied per request
inside a shared denoiser call, so neither splits batches."""

from omni_core.pipelines.shape_check import folder_config
from omni_core.sampling_fields import SamplingField

CFG_NORMALIZATION = SamplingField(
    name="cfg_normalization", type="float", default=0.0, min=0.0, max=100.0,
    help="Z-Image CFG renormalization: > 0 caps each guided prediction's norm at this many times the "
         "conditional one's (diffusers' cfg_normalization; 0 = off)")
CFG_TRUNCATION = SamplingField(
    name="cfg_truncation", type="float", default=1.0, min=0.0, max=1.0,
    help="Z-Image CFG truncation: steps whose normalized time (1000 - t) / 1000 exceeds this run without CFG "
         "(diffusers' cfg_truncation; 1.0 = CFG on every step)")

SAMPLING_FIELDS = (CFG_NORMALIZATION, CFG_TRUNCATION)


def vae_scale_factor(model_path: str | None) -> int:
    """diffusers: ``2 ** (len(vae.block_out_channels) - 1)`` (8 for Z-Image); 8 when the folder is unknown."""
    cfg = folder_config(model_path, "vae")
    return 2 ** (len(cfg["block_out_channels"]) - 1) if cfg and "block_out_channels" in cfg else 8


def size_rules(model_path: str | None) -> tuple[int, int, int]:
    """The record's ``size_rules`` (checked before the model loads) and the pipeline's own check: height and width
    multiples of vae_scale_factor * 2 (the 2x2 patches); no frames."""
    m = vae_scale_factor(model_path) * 2
    return m, m, 1
