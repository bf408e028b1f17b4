"""The per-step cost of each shape class, learned online from the waves the engine runs: no profiling run.

Why our own: the reference engine's budget-based batching needs a profiling run per machine to know what a
step of each shape costs. The engine times every wave anyway, so an exponential moving average of *seconds per
request-step* per batch key (the shape class: size, frames, outputs, guidance...) is free and follows the
machine as it is now (a shared CPU, a warm GPU). A shape not seen yet is estimated from the others' seconds
per token (pixels x frames x outputs), and with nothing seen at all there is no estimate (no cap).
"""

from __future__ import annotations

from omni_core.request import OmniDiffusionRequest


def request_tokens(request: OmniDiffusionRequest) -> int:
    """A request's work per step in pixels (height x width x frames x outputs): what a step's cost scales with."""
    sp = request.sampling_params
    return max(1, (sp.height or 1) * (sp.width or 1) * (sp.num_frames or 1) * (sp.num_outputs_per_prompt or 1))


class StepCostModel:
    """EMA of seconds per request-step by batch key, and of seconds per token-step over every key."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.per_request: dict[tuple, float] = {}
        self.per_token: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, key: tuple, tokens: int, batch: int, seconds: float) -> None:
        """One measured step of ``batch`` requests of shape ``key`` (``tokens`` each) that took ``seconds``."""
        if batch < 1 or seconds <= 0:
            return
        each = seconds / batch
        self.per_request[key] = self._ema(self.per_request.get(key), each)
        self.per_token = self._ema(self.per_token, each / max(1, tokens))

    def estimate(self, key: tuple, tokens: int) -> float | None:
        """Seconds one request of this shape adds to a step, or None before any wave was measured."""
        if key in self.per_request:
            return self.per_request[key]
        return None if self.per_token is None else self.per_token * tokens

    def max_batch(self, key: tuple, tokens: int, budget_s: float | None, limit: int) -> int:
        """How many requests of this shape fit one step of ``budget_s`` (at least 1, at most ``limit``)."""
        if budget_s is None:
            return limit
        each = self.estimate(key, tokens)
        if each is None or each <= 0:
            return limit
        return max(1, min(limit, int(budget_s / each)))
