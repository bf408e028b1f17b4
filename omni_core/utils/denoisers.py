"""``denoisers_of``: a pipeline's declared denoisers, for the layers below the pipelines (optimizers, sharded
loading) that must not import them. The specs' type is :class:`~omni_core.pipelines.denoiser.DenoiserSpec`."""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError


def denoisers_of(pipeline: Any) -> list[Any]:
    """The pipeline's declared denoiser specs; a ``ConfigError`` naming the pipeline if it declares none."""
    specs = list(pipeline.denoisers() if hasattr(pipeline, "denoisers") else [])
    if not specs:
        raise ConfigError(f"{type(pipeline).__name__} declares no denoisers (OmniPipeline.denoisers() returned "
                          f"nothing), so caches and sequence parallelism cannot be applied to it",
                          field="denoisers")
    return specs


__all__ = ["denoisers_of"]
