"""Entry-point module: registers ``Flux2Pipeline`` (FLUX.2 [dev]) and ``Flux2KleinPipeline`` (FLUX.2 [klein]).
Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec

#: what both pipelines can do (the DenoiserSpec's tp_plan and sp_plan, the core's CFG split)
PARALLEL = ("tensor", "ulysses", "ring", "cfg")


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="Flux2Pipeline",
        impl="omni_model_flux2.pipeline:Flux2Pipeline",
        requires=("torch", "diffusers", "transformers", "PIL"),
        supported_parallel=PARALLEL,
        description="FLUX.2 [dev] text-to-image and reference images (Mistral3 text encoder, embedded guidance); "
                    "request batching and step-wise",
        is_video=False,
        size_multiple=16,  # the released VAE; a folder's own VAE factor decides (size_rules)
        size_rules="omni_model_flux2.fields:size_rules",
    ), PipelineSpec(
        name="Flux2KleinPipeline",
        impl="omni_model_flux2.pipeline:Flux2KleinPipeline",
        requires=("torch", "diffusers", "transformers", "PIL"),
        supported_parallel=PARALLEL,
        description="FLUX.2 [klein] text-to-image and reference images (Qwen3 text encoder, CFG unless "
                    "step-distilled); request batching and step-wise",
        is_video=False,
        size_multiple=16,
        size_rules="omni_model_flux2.fields:size_rules",
    )]
