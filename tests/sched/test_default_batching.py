"""Batching by default (``omni_core.sched.capacity``): with ``max_num_seqs`` unset a wave holds up to
``AUTO_MAX_NUM_SEQS`` requests within ``AUTO_WAVE_PIXELS``; an explicit value is taken as given."""

from __future__ import annotations

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.request import OmniDiffusionRequest
from omni_core.sched.capacity import AUTO_MAX_NUM_SEQS, AUTO_WAVE_PIXELS, wave_limits
from omni_core.sched.request_scheduler import RequestScheduler


def _wave(config: OmniDiffusionConfig, n: int, size: int) -> int:
    sched = RequestScheduler(wave_limits(config)[0])
    sched.configure(config)
    for i in range(n):
        sched.add_request(OmniDiffusionRequest(prompt="x", request_id=f"r{i}",
                                               sampling_params=SamplingParams(height=size, width=size)))
    return len(sched.schedule().scheduled_ids)


def test_unset_batches_small_requests_and_caps_large_ones_by_pixels():
    auto = OmniDiffusionConfig(model="m")
    assert _wave(auto, 12, 64) == AUTO_MAX_NUM_SEQS
    assert _wave(auto, 12, 1024) == AUTO_WAVE_PIXELS // (1024 * 1024) == 4
    assert _wave(auto, 3, 4096) == 1, "a request above the budget alone still runs"


def test_explicit_max_num_seqs_is_taken_as_given():
    assert _wave(OmniDiffusionConfig(model="m", max_num_seqs=1), 5, 64) == 1
    assert _wave(OmniDiffusionConfig(model="m", max_num_seqs=12), 12, 1024) == 12
