"""Entry-point module: registers ``QwenImage21Pipeline``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_qwen_image21.fields import SAMPLING_FIELDS, SIZE_MULTIPLE


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="QwenImage21Pipeline",
        impl="omni_model_qwen_image21.pipeline:QwenImage21Pipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Qwen-Image 2.1 text-to-image (single-stream block-causal DiT, Qwen3-VL text); the text "
                    "prefix's keys/values computed once per request and reused every step; request batching and "
                    "step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=False,
        size_multiple=SIZE_MULTIPLE,
    )]
