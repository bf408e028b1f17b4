"""Entry-point module: registers ``ShapesPipeline`` and the model name ``shapes``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="ShapesPipeline",
        impl="omni_model_shapes.pipeline:ShapesPipeline",
        model_names=("shapes",),
        default_model_path="omni_model_shapes.weights:model_path",
        requires=("torch", "diffusers"),
        supported_parallel=("ulysses", "ring", "cfg"),
        is_video=False,
        size_multiple=4,  # the patch size; checked before the model loads
        description="demo text-to-image model: a coloured shape in one of five places, 32x32 RGB, runs on CPU",
    )]
