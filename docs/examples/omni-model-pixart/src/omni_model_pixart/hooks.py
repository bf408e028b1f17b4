"""Entry-point module: registers ``PixArtSigmaPipeline``. Imports nothing heavy (no torch, no diffusers)."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="PixArtSigmaPipeline",  # the _class_name of a PixArt-Sigma folder's model_index.json
        impl="omni_model_pixart.pipeline:PixArtSigmaPipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=("ulysses", "ring", "cfg"),
        description="PixArt-Sigma text-to-image (T5, DPM-Solver, CFG); request batching and step-wise",
        is_video=False,  # shape rules, read before the model loads; the class restates them
        size_multiple=16,  # the released folders (VAE factor 8 x 2x2 patches); a folder's own: size_rules
        size_rules="omni_model_pixart.rules:size_rules",
    )]
