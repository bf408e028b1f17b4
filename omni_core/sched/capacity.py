"""How many requests one wave may hold when the user does not say: batching is on by default.

A serving engine that runs one request at a time unless told otherwise leaves most of a device idle: on the
2-core CPU, ``omni serve shapes`` served 32 concurrent clients at 0.38 req/s with ``max_num_seqs=1`` and at 6.46
req/s with 8 (issue #37). A lone request waits for nothing (a wave takes what is queued, it never waits to fill),
so the default costs a single client nothing. What bounds a batch is memory, which grows with the pixels a wave
carries; the engine's process must not open the device to ask how much is free (docs/gpu.md), so the default is a
budget of pixel-frames per wave (``request_tokens``: height x width x frames x outputs, as the cost model
counts them): at most :data:`AUTO_MAX_NUM_SEQS` requests and :data:`AUTO_WAVE_PIXELS` of them, at least one.
An explicit ``max_num_seqs`` is taken as given (``1`` turns batching off); ``step_time_budget_s`` caps waves by
their learned step time on top of either.
"""

from __future__ import annotations

from typing import Any

#: requests per wave when ``max_num_seqs`` is unset
AUTO_MAX_NUM_SEQS = 8
#: pixel-frames per wave when ``max_num_seqs`` is unset: four 1024x1024 images (sixteen 512x512 would fit, but the
#: request cap binds first; one 81-frame 480x832 video is above it alone and still runs)
AUTO_WAVE_PIXELS = 4 * 1024 * 1024


def wave_limits(config: Any) -> tuple[int, int | None]:
    """``(requests per wave, pixel-frames per wave or None)`` for an engine config."""
    explicit = getattr(config, "max_num_seqs", None)
    if explicit is not None:
        return explicit, None
    return AUTO_MAX_NUM_SEQS, AUTO_WAVE_PIXELS


def fit_pixels(limit: int, tokens: int, budget: int | None) -> int:
    """``limit`` lowered so ``limit`` requests of ``tokens`` pixel-frames each stay within ``budget`` (>= 1)."""
    if budget is None:
        return limit
    return max(1, min(limit, budget // max(1, tokens)))


__all__ = ["AUTO_MAX_NUM_SEQS", "AUTO_WAVE_PIXELS", "fit_pixels", "wave_limits"]
