"""STEP_BATCH scheduling: a wave is one denoising step; requests join and leave between steps."""

from omni_core.sched.base import BaseScheduler


class StepScheduler(BaseScheduler):
    #: step counts and step indices are left out, so requests at different steps share a wave
    KEY_FIELDS = ("height", "width", "num_frames", "guidance_scale", "num_outputs_per_prompt", "max_sequence_length")
    #: between two steps a running request can be set aside (its step state stays on the worker) and resumed
    can_preempt = True
