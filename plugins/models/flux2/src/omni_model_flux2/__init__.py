"""Omni model plugin: FLUX.2 [dev] and [klein] (diffusers ``Flux2Pipeline`` / ``Flux2KleinPipeline`` folders)."""

__version__ = "0.1.0"
