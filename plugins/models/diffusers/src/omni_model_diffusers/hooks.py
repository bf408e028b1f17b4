"""Entry-point module: registers the generic diffusers pipeline. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="diffusers",
        impl="omni_model_diffusers.pipeline:DiffusersCallPipeline",
        requires=("torch", "diffusers", "transformers"),
        description="any diffusers pipeline folder no other plugin serves (or pipeline='diffusers'): requests run "
                    "through the pipeline's own call, batched when they share one",
        serves_any_folder=True,
        supported_parallel=("ulysses", "ring"),  # diffusers' context parallelism, where the transformer plans it
        size_rules="omni_model_diffusers.folder:size_rules",
        class_refusal="omni_model_diffusers.signature:class_refusal",
        class_description="omni_model_diffusers.modular:class_description",
    )]
