"""Hook specifications: the whole surface through which plugins extend Omni.

Every Omni plugin is an ordinary Python module (or object) with ``@omni_core.hookimpl`` functions whose
names match the specs below. Plugins are found through the single entry-point group
``omni_core.plugins``; the core's own built-ins register through the very same hooks.

Registration hooks take no arguments and return records (``omni_core.plugins.types``) that name the
implementation as a ``"module:attr"`` string, so listing plugins never imports torch or a kernel
library. This module imports nothing but pluggy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    import argparse

    from omni_core.plugins.types import (
        AttentionBackendSpec,
        CacheBackendSpec,
        ExecutorSpec,
        PipelineSpec,
        PlatformSpec,
        SchedulerSpec,
    )

PROJECT_NAME = "omni"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------------------------------
# Registration hooks: each returns records; the manager attributes every record to its distribution.
# --------------------------------------------------------------------------------------------------


@hookspec
def omni_register_platforms() -> Iterable[PlatformSpec]:
    """Register hardware platforms (device type, distributed backend, default attention kernel).

    Takes no arguments.

    :returns: an iterable of :class:`~omni_core.plugins.types.PlatformSpec`. Each names the platform
        class as ``"module:attr"`` and, for plugin platforms, a side-effect-free ``detect`` function
        (also ``"module:attr"``) that returns ``(available: bool, reason: str)``.

    **Called:** once per process when the plugin registry is first built (lazily, on the first
    lookup), in the main process and again in every worker process. Detection runs only when the
    current platform is resolved and must never create a device context.

    Example::

        @hookimpl
        def omni_register_platforms():
            return [PlatformSpec(name="cuda", impl="omni_platform_cuda.platform:CudaPlatform",
                                 detect="omni_platform_cuda.platform:detect")]
    """


@hookspec
def omni_register_attention_backends() -> Iterable[AttentionBackendSpec]:
    """Register attention kernels that the ``Attention`` layer can dispatch to.

    Takes no arguments.

    :returns: an iterable of :class:`~omni_core.plugins.types.AttentionBackendSpec`; ``impl`` points to
        an :class:`omni_core.attention.AttentionBackend` subclass. ``requires`` lists the import names
        the kernel needs, so ``omni env`` can say why a backend is unusable without importing it.

    **Called:** when the registry is first built, in every process; the backend class itself is
    imported only when a model's ``Attention`` layer selects it (inside the worker process).

    Example::

        @hookimpl
        def omni_register_attention_backends():
            return [AttentionBackendSpec(name="FLASH_ATTN", impl="omni_attention_flash.backend:FlashAttentionBackend",
                                         requires=("torch",))]
    """


@hookspec
def omni_register_cache_backends() -> Iterable[CacheBackendSpec]:
    """Register step-caching accelerators (TeaCache, cache-dit, ...).

    Takes no arguments.

    :returns: an iterable of :class:`~omni_core.plugins.types.CacheBackendSpec`; ``impl`` points to an
        :class:`omni_core.cache.CacheBackend` subclass, constructed with the user's ``cache_config``.

    **Called:** when the registry is first built; the backend is instantiated in each worker process
    after the pipeline is loaded, when ``OmniDiffusionConfig.cache_backend`` names it.

    Example::

        @hookimpl
        def omni_register_cache_backends():
            return [CacheBackendSpec(name="tea_cache", impl="omni_cache_teacache.backend:TeaCacheBackend")]
    """


@hookspec
def omni_register_pipelines() -> Iterable[PipelineSpec]:
    """Register model pipelines (what runs a diffusers-format model folder, or a named built-in model).

    Takes no arguments.

    :returns: an iterable of :class:`~omni_core.plugins.types.PipelineSpec`. ``name`` is the diffusers
        class name found in ``model_index.json`` (``_class_name``); ``model_names`` are short names a
        user may pass as ``model=`` (e.g. ``"shapes"``), resolved to ``default_model_path``.

    **Called:** when the registry is first built; the loader imports ``impl`` only in the process that
    loads the model (a worker, or the main process with the ``uni`` executor).

    Example::

        @hookimpl
        def omni_register_pipelines():
            return [PipelineSpec(name="WanPipeline", impl="omni_model_wan.pipeline:WanPipeline",
                                 supported_parallel=("ulysses", "ring", "cfg"))]
    """


@hookspec
def omni_register_schedulers() -> Iterable[SchedulerSpec]:
    """Register request schedulers (admission and batching policy).

    Takes no arguments.

    :returns: an iterable of :class:`~omni_core.plugins.types.SchedulerSpec`; ``impl`` points to a
        :class:`omni_core.sched.BaseScheduler` subclass. The core registers ``request`` and ``step``.

    **Called:** when the registry is first built; the engine instantiates the scheduler in the main
    process when it starts.

    Example::

        @hookimpl
        def omni_register_schedulers():
            return [SchedulerSpec(name="priority", impl="my_pkg.sched:PriorityScheduler")]
    """


@hookspec
def omni_register_executors() -> Iterable[ExecutorSpec]:
    """Register executors (how scheduled work reaches the model: in-process, worker processes, ...).

    Takes no arguments.

    :returns: an iterable of :class:`~omni_core.plugins.types.ExecutorSpec`; ``impl`` points to a
        :class:`omni_core.executor.DiffusionExecutor` subclass. The core registers ``uni`` and ``mp``.

    **Called:** when the registry is first built; the engine instantiates the executor in the main
    process when it starts.

    Example::

        @hookimpl
        def omni_register_executors():
            return [ExecutorSpec(name="ray", impl="my_pkg.ray_executor:RayExecutor")]
    """


# --------------------------------------------------------------------------------------------------
# CLI hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def omni_register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``omni`` command line.

    :param subparsers: the ``argparse`` sub-parser collection of the ``omni`` command. Add a parser
        with ``subparsers.add_parser(name, help=...)`` and set its handler with
        ``parser.set_defaults(func=callable)``; the callable receives the parsed ``argparse.Namespace``
        and returns an exit code (or ``None`` for 0).
    :returns: nothing.

    **Called:** once, in the CLI process, each time ``omni`` builds its argument parser (before
    arguments are parsed). Keep it cheap: import heavy modules inside the handler.

    Example::

        @hookimpl
        def omni_register_commands(subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.set_defaults(func=lambda args: print("hello"))
    """
