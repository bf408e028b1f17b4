"""Batch-invariant execution (``OmniDiffusionConfig.batch_invariant``): a request's images, latents and rollout
log-probabilities are the same bits whatever else shares its wave.

Why not batch-invariant kernels: on the CPU (and for any kernel library) a batched matrix product may sum in another
order than the same rows alone, and text padded to a wave's longest prompt is another computation than the prompt
alone. The one way that holds for every model and backend is to never fold two requests into one computation: each
state's text window, denoiser call and decode run on that state alone, while the engine still schedules waves
(requests join, leave and are preempted between steps as usual). The cost is the throughput batching gave. On a GPU
the same switch also asks torch for deterministic algorithms (cuBLAS workspace, cuDNN), since a kernel may pick
non-deterministic reductions even for one request.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable


def per_state(method: Callable) -> Callable:
    """``method(states)`` called once per state, results in order (``method`` returns one result per state)."""
    def one_at_a_time(states: list) -> list:
        return [out for state in states for out in method([state])]

    one_at_a_time.__wrapped__ = method  # type: ignore[attr-defined]
    return one_at_a_time


def make_batch_invariant(pipeline: Any, device: Any = None) -> None:
    """Install the per-state calls on ``pipeline`` (instance attributes: both the step path and the request path's
    ``forward`` go through them), and deterministic algorithms where the device is an accelerator."""
    pipeline.denoise_step = per_state(pipeline.denoise_step)
    pipeline.post_decode_batch = per_state(pipeline.post_decode_batch)
    window = pipeline.encoded_prompts

    @contextlib.contextmanager
    def encoded_alone(states: list):
        with contextlib.ExitStack() as stack:  # each request's texts in a window of its own
            yield [stack.enter_context(window([state])) for state in states]

    pipeline.encoded_prompts = encoded_alone
    if getattr(device, "type", str(device)) not in ("cpu", "meta"):
        import os

        import torch

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


__all__ = ["make_batch_invariant", "per_state"]
