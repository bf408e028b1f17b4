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


#: the denoiser components diffusers pipelines name (a pipeline run through its own call declares no spec)
DIFFUSERS_DENOISERS = ("transformer", "transformer_2", "unet", "prior", "decoder")


def denoiser_components(pipeline: Any) -> list[str]:
    """The component names ``quantize_components="denoiser"`` stands for: the declared denoisers, or, for a pipeline
    that runs a diffusers pipeline's own call (``diffusers_call_pipeline``), that pipeline's denoiser components."""
    whole = getattr(pipeline, "diffusers_call_pipeline", None)
    if whole is not None:
        names = [n for n in DIFFUSERS_DENOISERS if getattr(whole, n, None) is not None]
        if names:
            return names
    return [s.name for s in denoisers_of(pipeline)]


def repeated_blocks(pipeline: Any) -> list[tuple[str, list]]:
    """``[(region name, blocks)]`` that regional compile compiles: each declared denoiser's blocks, or, for a
    pipeline running a diffusers call, the blocks each denoiser names in diffusers' ``_repeated_blocks`` (what
    diffusers' own ``compile_repeated_blocks`` compiles)."""
    whole = getattr(pipeline, "diffusers_call_pipeline", None)
    if whole is None:
        return [(f"{s.name}.{'+'.join(s.blocks_attr)}", list(s.blocks)) for s in denoisers_of(pipeline)]
    out = []
    for name in denoiser_components(pipeline):
        module = getattr(whole, name)
        classes = set(getattr(module, "_repeated_blocks", None) or ())
        blocks = [m for m in module.modules() if type(m).__name__ in classes]
        if not blocks:
            raise ConfigError(f"compile=True: {type(module).__name__} ({name}) names no repeated blocks "
                              f"(diffusers' _repeated_blocks), so there is no region to compile", field="compile")
        out.append((f"{name}.{'+'.join(sorted(classes))}", blocks))
    return out


__all__ = ["denoiser_components", "denoisers_of", "repeated_blocks"]
