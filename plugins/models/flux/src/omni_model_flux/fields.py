"""FLUX's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline class.
Imports nothing heavy. Qwen-Image declares a field of the same name; each pipeline checks against its own."""

from omni_core.config import GUIDANCE_MAX
from omni_core.pipelines.shape_check import folder_config
from omni_core.sampling_fields import SamplingField

#: true CFG (diffusers' ``FluxPipeline(true_cfg_scale=...)``, default 1.0: off); one scale per batched call
TRUE_CFG_SCALE = SamplingField(
    name="true_cfg_scale", type="float", default=1.0, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="FLUX's true CFG scale; > 1 with a negative prompt runs the negative branch (guidance_scale stays the "
         "embedded distilled guidance)")

SAMPLING_FIELDS = (TRUE_CFG_SCALE,)


def vae_scale_factor(model_path: str | None) -> int:
    """diffusers: ``2 ** (len(vae.block_out_channels) - 1)`` (8 for FLUX.1); 8 when the folder is unknown."""
    cfg = folder_config(model_path, "vae")
    return 2 ** (len(cfg["block_out_channels"]) - 1) if cfg and "block_out_channels" in cfg else 8


def size_rules(model_path: str | None) -> tuple[int, int, int]:
    """The record's ``size_rules`` (checked before the model loads) and the pipeline's own check: height and width
    multiples of vae_scale_factor * 2 (the 2x2 latent packing); no frames."""
    m = vae_scale_factor(model_path) * 2
    return m, m, 1
