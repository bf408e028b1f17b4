"""``cache_config`` of ``cache_dit``: checked when the backend is built, with errors naming the field.

Names follow cache-dit's ``DBCacheConfig`` (and vLLM-Omni's for TaylorSeer/SCM); defaults are vLLM-Omni's
(F1B0, 4 warmup steps, threshold 0.24, at most 3 cached steps in a row).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from omni_core.errors import ConfigError, suggest

SCM_POLICIES = ("slow", "medium", "fast", "ultra")

#: key -> (default, what it takes)
KEYS: dict[str, tuple[Any, str]] = {
    "Fn_compute_blocks": (1, "integer >= 1: first blocks always computed (their residual decides); fewer than the "
                             "model's blocks"),
    "Bn_compute_blocks": (0, "integer >= 0: last blocks always computed"),
    "residual_diff_threshold": (0.24, "number >= 0: reuse while the Fn residual's relative change stays below it; "
                                      "0 = always compute"),
    "max_warmup_steps": (4, "integer >= 0: the first steps always compute"),
    "warmup_interval": (1, "integer >= 1: compute every this many steps during warmup"),
    "max_cached_steps": (-1, "integer >= -1: most cached steps per request (-1 = no limit)"),
    "max_continuous_cached_steps": (3, "integer >= -1: most cached steps in a row (-1 = no limit)"),
    "enable_taylorseer": (False, "true/false: TaylorSeer extrapolation of the cached residual"),
    "taylorseer_order": (1, "integer >= 1: TaylorSeer order"),
    "scm_steps_mask_policy": (None, f"null or one of {', '.join(SCM_POLICIES)}: a steps computation mask (SCM) "
                                    f"of cache-dit, sized to each request's steps"),
    "scm_steps_policy": ("dynamic", "dynamic or static: in SCM cache steps, still check the threshold (dynamic) "
                                    "or always reuse (static)"),
}


@attrs.frozen
class CacheDiTConfig:
    Fn_compute_blocks: int = 1
    Bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.24
    max_warmup_steps: int = 4
    warmup_interval: int = 1
    max_cached_steps: int = -1
    max_continuous_cached_steps: int = 3
    enable_taylorseer: bool = False
    taylorseer_order: int = 1
    scm_steps_mask_policy: str | None = None
    scm_steps_policy: str = "dynamic"

    @property
    def never_reuses(self) -> bool:
        """Threshold 0 without an SCM mask: cache-dit would compute every step."""
        return self.residual_diff_threshold <= 0 and self.scm_steps_mask_policy is None

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> CacheDiTConfig:
        config = dict(config or {})
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            key = unknown[0]
            hint = suggest(key, KEYS)
            raise ConfigError(f"cache_config key {key!r} is not a cache_dit option"
                              + (f" (did you mean {hint!r}?)" if hint else "")
                              + "; allowed keys: " + "; ".join(f"{k} ({v[1]})" for k, v in KEYS.items()),
                              field=f"cache_config.{key}")
        out: dict[str, Any] = {}
        for key, value in config.items():
            if value is None and key != "scm_steps_mask_policy":
                continue
            out[key] = _check(key, value)
        return cls(**out)


def _check(key: str, value: Any) -> Any:
    what = KEYS[key][1]
    bad = ConfigError(f"cache_config.{key}={value!r} is not allowed: {what}", field=f"cache_config.{key}")
    if key == "residual_diff_threshold":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad
        return float(value)
    if key == "enable_taylorseer":
        if not isinstance(value, bool):
            raise bad
        return value
    if key == "scm_steps_mask_policy":
        if value is not None and value not in SCM_POLICIES:
            raise bad
        return value
    if key == "scm_steps_policy":
        if value not in ("dynamic", "static"):
            raise bad
        return value
    minimum = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 0, "warmup_interval": 1,
               "max_cached_steps": -1, "max_continuous_cached_steps": -1, "taylorseer_order": 1}[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad
    return value
