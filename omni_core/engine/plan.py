"""``plan_engine``: everything about a config that can be decided and refused before any thread or worker starts.

The engine receives a finished :class:`EnginePlan` and only runs it (as vLLM's engine core receives a finished
config): the resolved model, the request limits, the execution mode, the wave capacity and the scheduler and
executor classes, after every cross-check (parallelism, LoRA, world size, performance preset, feature pairs,
platform options, cache config). A bad config fails here, so nothing needs tearing down.

    plan = plan_engine(OmniDiffusionConfig(model="shapes"))
    engine = DiffusionEngine(plan)
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.config import OmniDiffusionConfig, RequestLimits
from omni_core.engine.model_info import ModelInfo
from omni_core.engine.modes import ExecutionStrategy, mode_for
from omni_core.errors import ConfigError
from omni_core.pipelines.loader import ResolvedModel, check_parallel_support, resolve_model
from omni_core.sched.interface import SchedulerInterface


@attrs.frozen
class EnginePlan:
    """What the engine runs; built by :func:`plan_engine`, never half-checked."""

    #: the config with ``performance_mode``'s choices filled in
    config: OmniDiffusionConfig
    resolved: ResolvedModel
    pipeline_cls: type
    #: every request is checked against these (``config.limits`` over the model's)
    limits: RequestLimits
    #: what ``performance_mode`` chose, and why (``omni_core.optimize``)
    performance: dict
    #: the execution-mode strategy, chosen once (every mode difference lives in it)
    mode: ExecutionStrategy
    #: requests one wave may hold (the scheduler is built with it)
    capacity: int
    scheduler_cls: type
    executor_cls: type

    @property
    def model_info(self) -> ModelInfo:
        """What front ends are told about the served model (``EngineClient.model_info``)."""
        cls, spec = self.pipeline_cls, self.resolved.spec
        height, width, frames = cls.size_multiples(self.resolved.model_path)
        return ModelInfo(model=self.config.model, pipeline=spec.name, provider=spec.provider,
                         model_path=self.resolved.model_path, is_video=bool(getattr(cls, "is_video", False)),
                         frame_multiple=frames, size_multiple=max(height, width),
                         streaming=bool(self.config.streaming_output), sampling_fields=tuple(spec.sampling_fields),
                         image_input=cls.image_input, fps_field=spec.fps_field)

    def summary(self) -> dict[str, Any]:
        """The plan in words: which model, mode and classes (``omni env`` style, and for tests)."""
        return {"model": self.config.model, "pipeline": self.resolved.spec.name, "model_path": self.resolved.model_path,
                "mode": self.mode.mode.value, "capacity": self.capacity,
                "scheduler": f"{self.scheduler_cls.__module__}:{self.scheduler_cls.__qualname__}",
                "executor": f"{self.executor_cls.__module__}:{self.executor_cls.__qualname__}"}


def check_cache_config(pm: Any, backend: str, cache_config: dict) -> None:
    """The engine's part of validating ``cache_config`` once: what the config build did not check."""
    from omni_core.cache.base import CacheBackend

    cls = pm.load_component("cache", backend)
    own_check = getattr(cls.check_config, "__func__", None) is not CacheBackend.check_config.__func__
    if own_check or not getattr(pm.components("cache").get(backend), "options", ()):
        cls.check_config(cache_config)


def plan_engine(config: OmniDiffusionConfig, *, resolved: ResolvedModel | None = None) -> EnginePlan:
    """Resolve and check ``config`` into an :class:`EnginePlan`; raises ``ConfigError`` naming the field.

    ``resolved``: the model as the caller already resolved it for ``config.model`` (``omni serve`` checks the
    name before loading anything), so it is not resolved twice."""
    from omni_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    _start_process_server(config, pm)  # loads the libraries for the model processes while the checks below run
    resolved = resolved if resolved is not None else resolve_model(config.model, pm, config.pipeline)
    check_parallel_support(resolved, config.parallel_config)
    pipeline_cls = resolved.pipeline_cls()
    limits = pipeline_cls.request_limits(config.limits)
    if config.loras:  # preloaded LoRA adapters must fit the model before any worker starts
        from omni_core.lora import check_engine_loras

        check_engine_loras(config, pipeline_cls, resolved.model_path)
    from omni_core.platforms import check_world_size, platform_for

    check_world_size(config, platform_for(config))  # the configured platform runs here and can place the ranks
    from omni_core.optimize import check_config, resolve_preset

    # performance_mode fills the unset memory/speed options; then each is checked against this platform
    config, performance = resolve_preset(config, resolved.model_path, platform_for(config))
    from omni_core.combinations import check_combinations

    check_combinations(config)  # pairs of features that cannot run together (omni_core/combinations.py)
    check_config(config, platform_for(config))
    from omni_core.pipelines.stages import check_stage_config

    check_stage_config(config, pipeline_cls, resolved.model_path)  # decode_workers: what the split cannot run with
    # cache_config was checked against the backend's declared options when the config was built; a backend that
    # declares none, or checks more than its options (its own check_config), is asked here, before any worker
    check_cache_config(pm, config.cache_backend, config.cache_config)
    mode = mode_for(config, pipeline_cls, resolved.spec.name)
    from omni_core.sched.capacity import wave_limits

    capacity = mode.capacity(pipeline_cls, wave_limits(config)[0])  # unset: batching by default
    # the scheduler the mode needs unless one is named (streaming may stay in request mode: modes.mode_for)
    scheduler_name = config.scheduler or ("step" if mode.mode.value == "step_batch" else "request")
    scheduler_cls = pm.load_component("scheduler", scheduler_name)
    if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, SchedulerInterface)):
        raise ConfigError(f"scheduler {scheduler_name!r} is {scheduler_cls!r}, which does not subclass "
                          f"omni_core.sched.SchedulerInterface (subclass omni_core.sched.BaseScheduler for the "
                          f"lifecycle; docs/scheduling.md)", field="scheduler")
    executor_cls = pm.load_component("executor", config.executor_name)
    return EnginePlan(config=config, resolved=resolved, pipeline_cls=pipeline_cls, limits=limits,
                      performance=performance, mode=mode, capacity=capacity, scheduler_cls=scheduler_cls,
                      executor_cls=executor_cls)


def _start_process_server(config: OmniDiffusionConfig, pm: Any) -> None:
    """Start Omni's fork server now (in the background) when this engine will start processes on this host (an
    executor that declares ``local_processes``, or a stage apart, unless the executor's ``remote_stages``); a plan
    that fails leaves only the idle server."""
    try:
        spec = pm.get_component("executor", config.executor_name)
        local, remote_stages = spec.local_processes, spec.remote_stages
    except Exception:  # noqa: BLE001 - an unknown executor is refused below, with its message
        local = remote_stages = False
    if local or ((config.encode_workers or config.decode_workers) and not remote_stages):
        from omni_core.processes import start_server_soon

        start_server_soon()


__all__ = ["EnginePlan", "plan_engine"]
