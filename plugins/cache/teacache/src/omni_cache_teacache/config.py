"""``cache_config`` of ``tea_cache``: its keys are :class:`~omni_core.options.Option` records (:data:`OPTIONS`, on the
backend's registration record), so the core checks them when the engine's config is built, ``omni env`` and
``--help`` list them, and the errors name the field and the allowed keys. The same checks apply to the defaults
a model ships (its spec's ``cache_defaults["tea_cache"]`` and its folder's ``cache_defaults.json``)."""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.options import Option, validate_options

#: the keys of ``cache_config``; every default is None: the model's shipped value, else :data:`GENERIC_DEFAULTS`
OPTIONS = (
    Option(name="rel_l1_thresh", type="float", min=0,
           help="reuse while the accumulated rescaled change stays below it; 0 = always compute (default: the "
                "model's shipped one, else 0.1)"),
    Option(name="coefficients", type="floats",
           help="highest power first: the polynomial that rescales the input change (default: the model's shipped "
                "one, else [1, 0]: the raw change; fit one with `omni cache calibrate`)"),
    Option(name="warmup_steps", type="int", min=0,
           help="the first steps always compute (default: the model's shipped one, else 1; at least 1)"),
    Option(name="max_consecutive_reuse", type="int", min=1,
           help="compute after this many reused steps in a row (default: no limit)"),
)


@attrs.frozen
class TeaCacheConfig:
    """User overrides; ``None`` means "the denoiser's default" (its spec's / folder's shipped defaults, else
    :data:`GENERIC_DEFAULTS`)."""

    rel_l1_thresh: float | None = None
    coefficients: tuple[float, ...] | None = None
    warmup_steps: int | None = None
    max_consecutive_reuse: int | None = None


def tea_cache_config(config: dict[str, Any] | None) -> TeaCacheConfig:
    """``config`` checked against :data:`OPTIONS` (a ``ConfigError`` naming ``cache_config.<key>``)."""
    return TeaCacheConfig(**validate_options(config, OPTIONS, prefix="cache_config.", owner="a tea_cache option"))


#: what a denoiser that ships no tea_cache defaults runs with: the raw relative change of its modulated input
GENERIC_DEFAULTS = TeaCacheConfig(rel_l1_thresh=0.1, coefficients=(1.0, 0.0), warmup_steps=1)
