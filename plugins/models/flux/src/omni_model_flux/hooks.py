"""Entry-point module: registers ``FluxPipeline``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_flux.fields import SAMPLING_FIELDS


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="FluxPipeline",
        impl="omni_model_flux.pipeline:FluxPipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="FLUX.1 text-to-image (dev: embedded guidance; schnell; true CFG); request batching and "
                    "step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=False,
        size_multiple=16,  # the released VAE; a folder's own VAE factor decides (size_rules)
        size_rules="omni_model_flux.fields:size_rules",
    )]
