"""Entry-point module: registers ``QwenImagePipeline``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_qwen_image.fields import SAMPLING_FIELDS


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="QwenImagePipeline",
        impl="omni_model_qwen_image.pipeline:QwenImagePipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("ulysses", "ring", "cfg"),
        description="Qwen-Image text-to-image (true CFG with norm rescale); request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
    )]
