"""Omni model plugin: FLUX.1 (diffusers ``FluxPipeline`` folders)."""

__version__ = "0.1.0"
