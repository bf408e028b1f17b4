"""Entry-point module: registers ``HunyuanVideo15Pipeline`` and ``HunyuanVideo15ImageToVideoPipeline``. Imports
nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec


@hookimpl
def omni_register_pipelines():
    common = dict(requires=("torch", "diffusers", "transformers"), supported_parallel=("tensor", "ulysses", "ring", "cfg"),
                  is_video=True, size_multiple=16, frame_multiple=4,
                  size_rules="omni_model_hunyuan_video15.fields:shape_rules")
    return [PipelineSpec(
        name="HunyuanVideo15Pipeline", impl="omni_model_hunyuan_video15.pipeline:HunyuanVideo15Pipeline",
        description="HunyuanVideo 1.5 text-to-video; request batching and step-wise", **common,
    ), PipelineSpec(
        name="HunyuanVideo15ImageToVideoPipeline",
        impl="omni_model_hunyuan_video15.i2v:HunyuanVideo15ImageToVideoPipeline",
        description="HunyuanVideo 1.5 image-to-video; request batching and step-wise", **common,
    )]
