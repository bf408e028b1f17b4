"""Built-in plugin: the ``request`` and ``step`` schedulers."""

from omni_core.plugins.hookspecs import hookimpl
from omni_core.plugins.types import SchedulerSpec


@hookimpl(trylast=True)
def omni_register_schedulers():
    return [
        SchedulerSpec(name="request", impl="omni_core.sched.request_scheduler:RequestScheduler",
                      description="whole requests per wave (REQUEST_BATCH)"),
        SchedulerSpec(name="step", impl="omni_core.sched.step_scheduler:StepScheduler",
                      description="one denoising step per wave, requests join and leave between steps (STEP_BATCH)"),
    ]
