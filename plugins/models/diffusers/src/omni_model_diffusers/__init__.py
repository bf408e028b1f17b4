"""Omni model plugin: any diffusers pipeline folder, run through the pipeline's own call."""
