"""Entry-point module: registers ``WanPipeline`` and ``WanImageToVideoPipeline``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_wan.fields import SAMPLING_FIELDS


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="WanPipeline",
        impl="omni_model_wan.pipeline:WanPipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Wan 2.1 / 2.2 (two experts) text-to-video; request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=True,
        size_multiple=16,  # the released VAE and patch size; a folder's own decide (size_rules)
        frame_multiple=4,
        size_rules="omni_model_wan.fields:shape_rules",
    ), PipelineSpec(
        name="WanImageToVideoPipeline",
        impl="omni_model_wan.i2v:WanImageToVideoPipeline",
        # ftfy: diffusers' image-to-video prompt cleaning calls it unconditionally
        requires=("torch", "diffusers", "transformers", "ftfy"),
        supported_parallel=("tensor", "ulysses", "ring", "cfg"),
        description="Wan 2.1 / 2.2 (two experts, TI2V) image-to-video; request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=True,
        size_multiple=16,  # the released VAE and patch size; a folder's own decide (size_rules)
        frame_multiple=4,
        size_rules="omni_model_wan.fields:shape_rules",
    )]
