"""Wan's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline class.
Imports nothing heavy."""

from omni_core.config import GUIDANCE_MAX
from omni_core.sampling_fields import SamplingField

#: Wan 2.2's second expert (low-noise stage); unset: ``guidance_scale``. One scale per batched call: splits batches
GUIDANCE_SCALE_2 = SamplingField(
    name="guidance_scale_2", type="float", default=None, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="Wan 2.2's second-expert (low-noise stage) guidance scale; default: guidance_scale; needs a two-expert "
         "folder")

SAMPLING_FIELDS = (GUIDANCE_SCALE_2,)
