"""REQUEST_BATCH scheduling: a wave is a set of whole, compatible requests run to completion together."""

from omni_core.sched.base import BaseScheduler


class RequestScheduler(BaseScheduler):
    #: everything that shapes the batched computation, step count included (the wave runs all its steps)
    KEY_FIELDS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "num_outputs_per_prompt",
                  "max_sequence_length")
    #: a wave runs its requests to completion: priorities order the queue, nothing is preempted
    can_preempt = False
    steps_per_wave_is_one = False
