"""Entry-point module: registers ``ZImagePipeline``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_z_image.fields import SAMPLING_FIELDS


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="ZImagePipeline",
        impl="omni_model_z_image.pipeline:ZImagePipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Z-Image / Z-Image-Turbo text-to-image (CFG with truncation and renormalization); request "
                    "batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=False,
        size_multiple=16,  # the released VAE; a folder's own VAE factor decides (size_rules)
        size_rules="omni_model_z_image.fields:size_rules",
    )]
