"""``uni``: the model runs in the engine's own process (no IPC, simplest to debug)."""

from __future__ import annotations

from omni_core.executor.base import DiffusionExecutor
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.worker.transport import outputs_to_host


class UniProcExecutor(DiffusionExecutor):
    def start(self) -> None:
        from omni_core.platforms import platform_for
        from omni_core.utils.dtypes import torch_dtype
        from omni_core.worker.runner import ModelRunner

        platform = platform_for(self.config)
        if self.config.world_size != 1:
            from omni_core.errors import ConfigError

            raise ConfigError(f"executor 'uni' runs one process but parallel_config needs {self.config.world_size}; "
                              f"use executor='mp'", field="executor")
        from omni_core.platforms.threads import apply_thread_policy

        apply_thread_policy(self.config)
        device = platform.get_torch_device(0)
        platform.set_device(device)
        self.runner = ModelRunner(self.config, self.resolved, device=device, dtype=torch_dtype(self.config, platform),
                                  on_progress=self._progress if self.on_progress is not None else None)
        self.runner.load_model()

    def _progress(self, events: list[tuple[str, int, int]]) -> None:
        for event in events:
            self.on_progress(*event)

    def execute_batch(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return outputs_to_host(self.runner.execute_batch(sched))  # host outputs, as every executor delivers

    def execute_step(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return outputs_to_host(self.runner.execute_step(sched))

    def abort(self, request_ids: list[str]) -> None:
        self.runner.abort(request_ids)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        import traceback

        from omni_core.executor.collective import check_method, gathered

        check_method(method)
        try:
            answer = (True, getattr(self.runner, method)(*args, **(kwargs or {})))
        except Exception:  # noqa: BLE001 - named as a rank's failure, as every executor names it
            answer = (False, traceback.format_exc())
        return gathered(method, {0: answer}, 1)

    def release(self, request_ids: list[str]) -> set[str]:
        self.runner.release(request_ids)
        return self.runner.held_ids()

    def shutdown(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.states.clear()
            runner.lanes.shutdown()
            runner.pipeline = None
