"""One stochastic step of a flow-matching sampler with its log-probability: what RL post-training of flow models
(Flow-GRPO, DanceGRPO, MixGRPO) samples with and scores (issue #52).

A flow model predicts the velocity ``v`` at ``(x, sigma)``; the ODE step is ``x + (sigma_next - sigma) v``. An RL
rollout instead draws ``x_prev ~ N(mean, std^2)`` around an SDE's mean so that each transition has a density, and the
trainer needs ``log p(x_prev | x)``. The four families, from their published formulas (``peers-2026-12-06.md``
section 1.1; Flow-GRPO's ``sde_step_with_logprob``, its ``cps`` variant, DanceGRPO's, and the ODE), all in fp32:

* ``sde``: ``std_t = sqrt(sigma / (1 - sigma')) * noise_level`` (``sigma' = sigmas[1]`` where ``sigma == 1``),
  ``mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt``, ``std = std_t sqrt(-dt)``;
* ``cps``: ``std = sigma_next sin(noise_level pi / 2)``, ``x0 = x - sigma v``, ``x1 = x + (1 - sigma) v``,
  ``mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1``; its log-prob is ``-(x_prev - mean)^2``;
* ``dance_sde``: ``score = -(x - (1 - sigma) x0) / sigma^2``, ``mean = x + dt v - 0.5 noise_level^2 score dt``,
  ``std = noise_level sqrt(-dt)``;
* ``ode``: ``mean = x + dt v``, no noise; its log-prob is ``-(x_prev - mean)^2`` (0 on its own sample).

``dt = sigma_next - sigma < 0``. The Gaussian log-density (``sde``, ``dance_sde``) is taken with its constant
(``-log std - log sqrt(2 pi)``) or without, and every log-prob is the mean over a sample's non-batch dimensions:
one number per sample per step. Given ``prev_sample`` the step scores that stored transition instead of drawing.

Why Omni writes this rather than reusing a library: diffusers' schedulers have no log-probability, and the
trainers' versions are patches of one pipeline each; the step-wise contract needs it per request, per row.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from omni_core.config.rollout import SDE_TYPES
from omni_core.errors import ConfigError


@attrs.frozen
class FlowStep:
    """One step's result: the next sample, its log-probability per sample (``[B]``, fp32), and the Gaussian it
    was drawn from (``mean`` and ``std``; ``std`` 0 for the ODE)."""

    prev_sample: Any
    log_prob: Any
    mean: Any
    std: Any


def check_sde_type(sde_type: str, field: str = "sde_type") -> str:
    if sde_type not in SDE_TYPES:
        raise ConfigError(f"{field}={sde_type!r} is not an SDE this engine samples with; allowed: "
                          f"{', '.join(SDE_TYPES)}", field=field)
    return sde_type


def flow_sde_step(velocity: Any, sample: Any, sigma: float, sigma_next: float, *, sde_type: str = "sde",
                  noise_level: float = 0.7, sigma_max: float | None = None, generator: Any = None,
                  prev_sample: Any = None, with_constant: bool = True) -> FlowStep:
    """The step from ``sample`` at ``sigma`` to ``sigma_next`` (see the module's docstring). ``sigma_max``: the
    schedule's second sigma (Flow-GRPO's stand-in for ``sigma`` where ``sigma == 1``); ``generator``: the request's,
    for the noise; ``prev_sample``: a stored next sample to score instead of drawing one."""
    import torch

    check_sde_type(sde_type)
    x, v = sample.float(), velocity.float()
    sigma, sigma_next = float(sigma), float(sigma_next)
    dt = sigma_next - sigma
    if dt >= 0:
        raise ValueError(f"a flow step goes down in sigma: sigma={sigma}, sigma_next={sigma_next}")
    if sde_type == "sde":
        denominator = 1.0 - (float(sigma_max) if sigma == 1.0 and sigma_max is not None else sigma)
        std_t = math.sqrt(sigma / denominator) * noise_level
        mean = x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_t * math.sqrt(-dt)
    elif sde_type == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        x0, x1 = x - sigma * v, x + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + x1 * math.sqrt(max(sigma_next ** 2 - std ** 2, 0.0))
    elif sde_type == "dance_sde":
        x0 = x - sigma * v
        score = -(x - x0 * (1 - sigma)) / sigma ** 2
        mean = x + dt * v - 0.5 * noise_level ** 2 * score * dt
        std = noise_level * math.sqrt(-dt)
    else:
        mean, std = x + dt * v, 0.0
    if prev_sample is None:
        if std > 0:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device="cpu").to(x.device)
            prev_sample = mean + std * noise
        else:
            prev_sample = mean
    prev = prev_sample.float()
    dims = tuple(range(1, prev.dim()))
    if sde_type in ("cps", "ode") or std == 0:
        log_prob = -((prev - mean) ** 2)
    else:
        log_prob = -((prev - mean) ** 2) / (2 * std ** 2)
        if with_constant:
            log_prob = log_prob - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return FlowStep(prev_sample=prev, log_prob=log_prob.mean(dim=dims) if dims else log_prob, mean=mean,
                    std=torch.tensor(std, dtype=torch.float32))


__all__ = ["SDE_TYPES", "FlowStep", "check_sde_type", "flow_sde_step"]
