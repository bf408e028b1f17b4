"""Qwen-Image's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline
class. Imports nothing heavy."""

from omni_core.config import GUIDANCE_MAX
from omni_core.pipelines.shape_check import folder_config
from omni_core.sampling_fields import SamplingField

#: true CFG (diffusers' ``true_cfg_scale``): one scale per batched denoiser call, so it splits batches
TRUE_CFG_SCALE = SamplingField(
    name="true_cfg_scale", type="float", default=4.0, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="Qwen-Image's true CFG scale; > 1 with a negative prompt turns CFG on")

SAMPLING_FIELDS = (TRUE_CFG_SCALE,)


def vae_scale_factor(model_path: str | None) -> int:
    """diffusers: ``2 ** len(vae.temperal_downsample)`` (8 for Qwen-Image); 8 when the folder is unknown."""
    cfg = folder_config(model_path, "vae")
    if cfg and "temperal_downsample" in cfg:
        return 2 ** len(cfg["temperal_downsample"])
    return 8


def size_rules(model_path: str | None) -> tuple[int, int, int]:
    """The record's ``size_rules`` (checked before the model loads) and the pipeline's own check: height and width
    multiples of vae_scale_factor * 2 (the 2x2 latent packing, 16 for Qwen-Image); no frames."""
    m = vae_scale_factor(model_path) * 2
    return m, m, 1
