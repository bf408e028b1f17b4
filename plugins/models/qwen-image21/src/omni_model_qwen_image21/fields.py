"""Qwen-Image 2.1's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline
class. Imports nothing heavy."""

from omni_core.config import GUIDANCE_MAX
from omni_core.sampling_fields import SamplingField

#: true CFG (diffusers' ``true_cfg_scale``, default 1.0: Qwen-Image 2.1 is meant to be sampled without guidance);
#: one scale per batched denoiser call, so it splits batches
TRUE_CFG_SCALE = SamplingField(
    name="true_cfg_scale", type="float", default=1.0, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="Qwen-Image 2.1's true CFG scale (default 1.0: off); > 1 with a negative prompt turns CFG on")

SAMPLING_FIELDS = (TRUE_CFG_SCALE,)

#: diffusers' ``QwenImage21Pipeline.vae_scale_factor`` (fixed, not read from the VAE) times the 2x2 slot packing:
#: height and width are multiples of 32
SIZE_MULTIPLE = 32
