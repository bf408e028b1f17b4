"""FLUX's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline class.
Imports nothing heavy. Qwen-Image declares a field of the same name; each pipeline checks against its own."""

from omni_core.config import GUIDANCE_MAX
from omni_core.sampling_fields import SamplingField

#: true CFG (diffusers' ``FluxPipeline(true_cfg_scale=...)``, default 1.0: off); one scale per batched call
TRUE_CFG_SCALE = SamplingField(
    name="true_cfg_scale", type="float", default=1.0, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="FLUX's true CFG scale; > 1 with a negative prompt runs the negative branch (guidance_scale stays the "
         "embedded distilled guidance)")

SAMPLING_FIELDS = (TRUE_CFG_SCALE,)
