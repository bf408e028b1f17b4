"""``cache_config`` of ``cache_dit``: its keys are :class:`~omni_core.options.Option` records (:data:`OPTIONS`, on the
backend's registration record), so the core checks them when the engine's config is built, ``omni env`` and
``--help`` list them, and the errors name the field.

Names follow cache-dit's ``DBCacheConfig`` (and vLLM-Omni's for TaylorSeer/SCM); defaults are vLLM-Omni's
(F1B0, 4 warmup steps, threshold 0.24, at most 3 cached steps in a row).
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.options import Option, validate_options

SCM_POLICIES = ("slow", "medium", "fast", "ultra")

#: the keys of ``cache_config`` with their defaults (the one place they are stated)
OPTIONS = (
    Option(name="Fn_compute_blocks", type="int", min=1, default=1,
           help="first blocks always computed (their residual decides); fewer than the model's blocks"),
    Option(name="Bn_compute_blocks", type="int", min=0, default=0, help="last blocks always computed"),
    Option(name="residual_diff_threshold", type="float", min=0, default=0.24,
           help="reuse while the Fn residual's relative change stays below it; 0 = always compute"),
    Option(name="max_warmup_steps", type="int", min=0, default=4, help="the first steps always compute"),
    Option(name="warmup_interval", type="int", min=1, default=1, help="compute every this many steps during warmup"),
    Option(name="max_cached_steps", type="int", min=-1, default=-1,
           help="most cached steps per request (-1 = no limit)"),
    Option(name="max_continuous_cached_steps", type="int", min=-1, default=3,
           help="most cached steps in a row (-1 = no limit)"),
    Option(name="enable_taylorseer", type="bool", default=False,
           help="TaylorSeer extrapolation of the cached residual"),
    Option(name="taylorseer_order", type="int", min=1, default=1, help="TaylorSeer order"),
    Option(name="scm_steps_mask_policy", type="choice", choices=SCM_POLICIES,
           help="a steps computation mask (SCM) of cache-dit, sized to each request's steps (default: none)"),
    Option(name="scm_steps_policy", type="choice", choices=("dynamic", "static"), default="dynamic",
           help="in SCM cache steps, still check the threshold (dynamic) or always reuse (static)"),
)


@attrs.frozen(kw_only=True)
class CacheDiTConfig:
    """The settings cache-dit runs with, every one filled (from :data:`OPTIONS`' defaults where unset)."""

    Fn_compute_blocks: int
    Bn_compute_blocks: int
    residual_diff_threshold: float
    max_warmup_steps: int
    warmup_interval: int
    max_cached_steps: int
    max_continuous_cached_steps: int
    enable_taylorseer: bool
    taylorseer_order: int
    scm_steps_mask_policy: str | None
    scm_steps_policy: str

    @property
    def never_reuses(self) -> bool:
        """Threshold 0 without an SCM mask: cache-dit would compute every step."""
        return self.residual_diff_threshold <= 0 and self.scm_steps_mask_policy is None


def cache_dit_config(config: dict[str, Any] | None) -> CacheDiTConfig:
    """``config`` checked against :data:`OPTIONS` (a ``ConfigError`` naming ``cache_config.<key>``), defaults filled."""
    return CacheDiTConfig(**validate_options(config, OPTIONS, prefix="cache_config.", owner="a cache_dit option"))
