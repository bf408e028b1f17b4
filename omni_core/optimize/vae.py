"""VAE tiling and slicing: diffusers' own ``enable_tiling`` / ``enable_slicing`` on the pipeline's VAE.

Tiling decodes (and encodes) overlapping spatial tiles and blends the seams, so large images and long videos
fit; it is exact when a tile covers the whole image and otherwise equals diffusers' own tiled decode (it *is*
diffusers' code). Slicing decodes a batch one sample at a time (within 1e-5 of the batched decode).
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError


def vae_of(pipeline: Any) -> Any:
    from omni_core.optimize.components import components_of

    return components_of(pipeline).get("vae")


def apply_vae_options(pipeline: Any, tiling: Any, slicing: Any) -> dict[str, Any]:
    """Turn on tiling (``True`` or a dict of ``enable_tiling`` keyword arguments, e.g.
    ``{"tile_sample_min_height": 64}``) and/or slicing; a ConfigError if the pipeline has no VAE that can."""
    done: dict[str, Any] = {}
    if not tiling and not slicing:
        return done
    vae = vae_of(pipeline)
    for field, on, method in (("vae_tiling", tiling, "enable_tiling"), ("vae_slicing", slicing, "enable_slicing")):
        if not on:
            continue
        if vae is None or not hasattr(vae, method):
            raise ConfigError(f"{field}={on!r}: {type(pipeline).__name__} has no VAE with {method} "
                              f"({'no vae component' if vae is None else type(vae).__name__})", field=field)
        kwargs = dict(on) if isinstance(on, dict) else {}
        try:
            getattr(vae, method)(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{field}={on!r}: {type(vae).__name__}.{method} refused the options: {exc}",
                              field=field) from None
        done[field] = kwargs or True
    return done
