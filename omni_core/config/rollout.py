"""``RolloutOptions``: what a request asks of an RL rollout (``SamplingParams.rollout``, issue #52).

A request with ``rollout`` set samples with a stochastic flow step on the chosen steps (``sde_steps``; ODE
elsewhere) and gets back, per sample and step, the log-probability of the transition it drew
(``DiffusionOutput.rollout``), optionally with the latent trajectory and the Gaussians it was drawn from. Any model
whose steps go through the core's flow step (``omni_core.pipelines.rollout``) gets it; another is refused naming
the field. The step's formulas: ``omni_core.pipelines.flow_sde``.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.config.bounds import MAX_INFERENCE_STEPS
from omni_core.config.validators import _FromKwargs, bool_field, choice_field, coerce_record, float_field
from omni_core.errors import ConfigError

#: the SDE families a request may ask for (``sde_type``)
SDE_TYPES = ("sde", "cps", "dance_sde", "ode")


def _steps(value: Any) -> tuple[int, ...] | None:
    """``sde_steps``: None (every step), a list of step indices, or ``{"start": a, "stop": b}`` (a window)."""
    if value is None:
        return None
    if isinstance(value, dict):
        unknown = set(value) - {"start", "stop"}
        if unknown or "stop" not in value:
            raise ConfigError(f"RolloutOptions.sde_steps: a window is {{'start': a, 'stop': b}} (stop required), got "
                              f"{value!r}", field="rollout.sde_steps")
        value = range(int(value.get("start", 0)), int(value["stop"]))
    try:
        steps = tuple(sorted({int(i) for i in value}))
    except (TypeError, ValueError):
        raise ConfigError(f"RolloutOptions.sde_steps must be step indices (a list of ints) or a window "
                          f"{{'start': a, 'stop': b}}, got {value!r}", field="rollout.sde_steps") from None
    if not steps or steps[0] < 0 or steps[-1] >= MAX_INFERENCE_STEPS:
        raise ConfigError(f"RolloutOptions.sde_steps={value!r} is invalid: at least one index, each in "
                          f"[0, {MAX_INFERENCE_STEPS})", field="rollout.sde_steps")
    return steps


@attrs.frozen
class RolloutOptions(_FromKwargs):
    """A request's rollout: ``sde_type`` (sde, cps, dance_sde, ode), ``noise_level`` (eta), ``sde_steps`` (the
    steps that draw noise and are scored; None: all), ``log_prob_constant`` (the Gaussian's ``-log std -
    log sqrt(2 pi)``), ``trajectory`` (the latents before and after each chosen step), ``details`` (each chosen
    step's mean, std and model output)."""

    sde_type: str = attrs.field(default="sde", validator=choice_field(SDE_TYPES))
    noise_level: float = attrs.field(default=0.7, validator=float_field(min=0.0, max=10.0))
    sde_steps: tuple[int, ...] | None = attrs.field(default=None, converter=_steps)
    log_prob_constant: bool = attrs.field(default=True, validator=bool_field)
    trajectory: bool = attrs.field(default=False, validator=bool_field)
    details: bool = attrs.field(default=False, validator=bool_field)

    def chosen(self, step: int) -> bool:
        return self.sde_steps is None or step in self.sde_steps


def coerce_rollout(value: Any) -> RolloutOptions | None:
    """``SamplingParams.rollout``: None (no rollout), True / an SDE name (the defaults, that type), a mapping of
    :class:`RolloutOptions` fields, or an instance."""
    if value is None or value is False:
        return None
    if value is True:
        return RolloutOptions()
    return coerce_record(RolloutOptions, value, field="rollout", shorthand="sde_type",
                         error="SamplingParams.rollout must be None, True, an SDE type, or a mapping of "
                               "RolloutOptions fields, got {value!r}")


__all__ = ["SDE_TYPES", "RolloutOptions", "coerce_rollout"]
