"""Qwen-Image's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline
class. Imports nothing heavy."""

from omni_core.config import GUIDANCE_MAX
from omni_core.sampling_fields import SamplingField

#: true CFG (diffusers' ``true_cfg_scale``): one scale per batched denoiser call, so it splits batches
TRUE_CFG_SCALE = SamplingField(
    name="true_cfg_scale", type="float", default=4.0, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="Qwen-Image's true CFG scale; > 1 with a negative prompt turns CFG on")

SAMPLING_FIELDS = (TRUE_CFG_SCALE,)
