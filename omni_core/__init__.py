"""Omni: a plugin-driven inference engine for diffusion models.

``import omni_core`` stays light (pluggy and attrs only); the runtime (torch, diffusers) loads on first use
of ``Omni``, ``AsyncOmni`` and friends through module ``__getattr__``.
"""

from omni_core.plugins.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

# public name -> "module:attr", imported on first access
_LAZY = {
    "OmniDiffusionConfig": "omni_core.config:OmniDiffusionConfig",
    "SamplingParams": "omni_core.config:SamplingParams",
    "AttentionConfig": "omni_core.config:AttentionConfig",
    "ParallelConfig": "omni_core.config:ParallelConfig",
    "get_plugin_manager": "omni_core.plugins.manager:get_plugin_manager",
    "Omni": "omni_core.entrypoints.omni:Omni",
    "AsyncOmni": "omni_core.entrypoints.async_omni:AsyncOmni",
    "DiffusionOutput": "omni_core.outputs:DiffusionOutput",
    "OmniRequestOutput": "omni_core.outputs:OmniRequestOutput",
}

__all__ = ["__version__", "hookimpl", "hookspec", *_LAZY]


def __getattr__(name: str):
    # the helper loads on first use: ``import omni_core`` itself loads the hook specs only
    from omni_core.utils.lazy import lazy_exports

    return lazy_exports(__name__, _LAZY)(name)


def __dir__():
    from omni_core.utils.lazy import lazy_dir

    return lazy_dir(__name__, _LAZY)()
