"""Entry-point module: registers ``ToyPipeline`` and the short model name ``toy``. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="ToyPipeline",  # the _class_name in a toy model folder's model_index.json
        impl="omni_model_toy.pipeline:ToyPipeline",
        model_names=("toy",),  # Omni("toy") loads the folder default_model_path returns
        default_model_path="omni_model_toy.build:default_model_path",
        requires=("torch", "diffusers"),
        supported_parallel=("tensor", "ulysses", "ring"),
        is_video=False,  # shape rules, read before the model loads (the class may restate them: they must agree)
        size_multiple=2,
        description="worked example: a tiny random-weight text-to-image DiT (16x16 RGB)",
    )]
