"""``cache_config`` of ``tea_cache``: checked in the engine's process (``TeaCacheBackend.check_config``) and when
the backend is built, with errors naming the field and the allowed keys. The same checks apply to the defaults a
model ships (its spec's ``cache_defaults["tea_cache"]`` and its folder's ``cache_defaults.json``)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from omni_core.errors import ConfigError, suggest

#: key -> what it takes (shown in errors)
KEYS = {
    "rel_l1_thresh": "number >= 0: reuse while the accumulated rescaled change stays below it; 0 = always "
                     "compute (default: the model's shipped one, else 0.1)",
    "coefficients": "list of numbers, highest power first: the polynomial that rescales the input change "
                    "(default: the model's shipped one, else [1, 0]: the raw change; fit one with "
                    "`omni cache calibrate`)",
    "warmup_steps": "integer >= 0: the first steps always compute (default: the model's shipped one, else 1; "
                    "at least 1)",
    "max_consecutive_reuse": "integer >= 1 or null: compute after this many reused steps in a row "
                             "(default null: no limit)",
}


@attrs.frozen
class TeaCacheConfig:
    """User overrides; ``None`` means "the denoiser's default" (its spec's / folder's shipped defaults, else
    :data:`GENERIC_DEFAULTS`)."""

    rel_l1_thresh: float | None = None
    coefficients: tuple[float, ...] | None = None
    warmup_steps: int | None = None
    max_consecutive_reuse: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> TeaCacheConfig:
        config = dict(config or {})
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            key = unknown[0]
            hint = suggest(key, KEYS)
            raise ConfigError(f"cache_config key {key!r} is not a tea_cache option"
                              + (f" (did you mean {hint!r}?)" if hint else "")
                              + "; allowed keys: " + "; ".join(f"{k} ({v})" for k, v in KEYS.items()),
                              field=f"cache_config.{key}")
        out: dict[str, Any] = {}
        if config.get("rel_l1_thresh") is not None:
            out["rel_l1_thresh"] = _number(config["rel_l1_thresh"], "rel_l1_thresh", minimum=0.0)
        if config.get("coefficients") is not None:
            value = config["coefficients"]
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ConfigError(f"cache_config.coefficients={value!r} is not allowed: {KEYS['coefficients']}",
                                  field="cache_config.coefficients")
            coeffs = tuple(_number(v, "coefficients") for v in value)
            if not coeffs:
                raise ConfigError("cache_config.coefficients=[] is not allowed: give at least one number",
                                  field="cache_config.coefficients")
            out["coefficients"] = coeffs
        if config.get("warmup_steps") is not None:
            out["warmup_steps"] = _integer(config["warmup_steps"], "warmup_steps", minimum=0)
        if config.get("max_consecutive_reuse") is not None:
            out["max_consecutive_reuse"] = _integer(config["max_consecutive_reuse"], "max_consecutive_reuse",
                                                    minimum=1)
        return cls(**out)


def _number(value: Any, key: str, minimum: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (minimum is not None and value < minimum):
        raise ConfigError(f"cache_config.{key}={value!r} is not allowed: {KEYS[key]}", field=f"cache_config.{key}")
    return float(value)


def _integer(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"cache_config.{key}={value!r} is not allowed: {KEYS[key]}", field=f"cache_config.{key}")
    return value


#: what a denoiser that ships no tea_cache defaults runs with: the raw relative change of its modulated input
GENERIC_DEFAULTS = TeaCacheConfig(rel_l1_thresh=0.1, coefficients=(1.0, 0.0), warmup_steps=1)
