"""Built-in plugin: the ``uni`` (in-process) and ``mp`` (worker processes) executors."""

from omni_core.plugins.hookspecs import hookimpl
from omni_core.plugins.types import ExecutorSpec


@hookimpl(trylast=True)
def omni_register_executors():
    return [
        ExecutorSpec(name="uni", impl="omni_core.executor.uni:UniProcExecutor",
                     description="runs the model in the engine's process"),
        ExecutorSpec(name="mp", impl="omni_core.executor.mp:MultiProcExecutor",
                     description="worker processes over torch.distributed, tensors through shared memory",
                     local_processes=True),
    ]
