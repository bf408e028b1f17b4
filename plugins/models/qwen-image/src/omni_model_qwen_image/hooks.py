"""Entry-point module: registers ``QwenImagePipeline``, ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_qwen_image.fields import SAMPLING_FIELDS


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="QwenImagePipeline",
        impl="omni_model_qwen_image.pipeline:QwenImagePipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Qwen-Image text-to-image (true CFG with norm rescale); request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=False,
        size_multiple=16,  # the released VAE; a folder's own VAE factor decides (size_rules)
        size_rules="omni_model_qwen_image.fields:size_rules",
    ), PipelineSpec(
        name="QwenImageEditPipeline",
        impl="omni_model_qwen_image.edit:QwenImageEditPipeline",
        requires=("torch", "diffusers", "transformers", "PIL"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Qwen-Image-Edit: one input image + instruction (VL-encoded with the image, VAE condition "
                    "tokens); request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=False,
        size_multiple=16,  # the released VAE; a folder's own VAE factor decides (size_rules)
        size_rules="omni_model_qwen_image.fields:size_rules",
    ), PipelineSpec(
        name="QwenImageEditPlusPipeline",
        impl="omni_model_qwen_image.edit:QwenImageEditPlusPipeline",
        requires=("torch", "diffusers", "transformers", "PIL"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Qwen-Image-Edit-2509+: 1 to 3 input images + instruction; request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=False,
        size_multiple=16,  # the released VAE; a folder's own VAE factor decides (size_rules)
        size_rules="omni_model_qwen_image.fields:size_rules",
    )]
