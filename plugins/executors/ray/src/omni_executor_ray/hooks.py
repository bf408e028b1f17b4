"""Registers the ``ray`` executor (the class is imported only when selected; Ray only when it starts)."""

from omni_core import hookimpl
from omni_core.plugins.types import ExecutorSpec

from omni_executor_ray.options import OPTIONS


@hookimpl
def omni_register_executors():
    return [ExecutorSpec(name="ray", impl="omni_executor_ray.executor:RayExecutor", requires=("ray",),
                         description="one Ray actor per rank over torch.distributed; spans the nodes of a Ray cluster",
                         options=OPTIONS, remote_stages=True)]
