"""The cache backend interface: skip or reuse denoiser work across steps, with per-request state.

Unlike the reference (one state per module), every decision and every cached tensor lives in the
request's ``StepState.hook_state`` (``omni_core.hooks.request_state``; ``cache_state`` is its older name), so requests batched together -- even at different steps in one
STEP_BATCH wave -- each decide for themselves. Backends are built in the worker after the pipeline is
loaded, from ``OmniDiffusionConfig.cache_config``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class CacheBackend:
    """Base class of cache backends (``tea_cache``, ``cache_dit``, ...)."""

    #: the component name; optional, since the registration record states it (if set, it must agree)
    name: ClassVar[str] = ""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.enabled = False

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """Validate ``cache_config`` in the engine's process, before any worker starts: raise
        :class:`~omni_core.errors.ConfigError` naming the bad key and the allowed ones. The default checks it
        against the ``options`` (Option records) on the backend's ``CacheBackendSpec``, which the config also
        does when it is built; a backend declaring none takes nothing but an empty dict (or overrides this)."""
        from omni_core.errors import ConfigError
        from omni_core.options import validate_options
        from omni_core.plugins.manager import get_plugin_manager

        options = getattr(get_plugin_manager().components("cache").get(cls.name), "options", ())
        if options:
            validate_options(config, options, prefix="cache_config.", owner=f"a {cls.name} option")
        elif config:
            key = next(iter(config))
            raise ConfigError(f"cache backend {cls.name!r} takes no cache_config options, got {key!r}",
                              field=f"cache_config.{key}")

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether the backend can run here, and why not. The record's ``requires`` are checked before the class
        is imported (:func:`omni_core.plugins.availability.check_record`); override for anything beyond that."""
        return True, ""

    def enable(self, pipeline: Any) -> None:
        """Install hooks on the loaded pipeline (once, in each worker). A backend reads what it needs from the
        pipeline's declared :class:`~omni_core.pipelines.denoiser.DenoiserSpec` list
        (:func:`~omni_core.pipelines.denoiser.denoisers_of`) and never names a model."""
        self.enabled = True

    def disable(self, pipeline: Any) -> None:
        """Remove every hook; the pipeline then computes exactly as without a cache."""
        self.enabled = False

    def begin_request(self, state: Any) -> None:
        """Initialise the request's hook state (``state.hook_state``, also named ``cache_state``) for a new request
        (after ``prepare_encode``); rows with no request start afresh too (``omni_core.hooks.standalone_state``)."""
        from omni_core.hooks import forget_standalone_state

        state.cache_state.clear()
        forget_standalone_state()

    def request_metrics(self, state: Any) -> dict[str, Any]:
        """Statistics for the request's output metrics, e.g. ``{"steps_computed": 30, "steps_reused": 20}``."""
        return {}

    def is_enabled(self) -> bool:
        return self.enabled
