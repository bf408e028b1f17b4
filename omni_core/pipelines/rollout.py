"""The core's flow step: a request's scheduler step, or, when it asks for a rollout (``SamplingParams.rollout``), the
stochastic flow step with its log-probability (:mod:`omni_core.pipelines.flow_sde`), recorded on the request's state
and returned with its output (``DiffusionOutput.rollout``).

Why in the core: a model that advances its latents through :func:`flow_step` (``DiffusersStepPipeline`` does, for
every first-party model on it, and ``shapes``) gets rollouts for every request by that alone; none writes the SDE.
A model declares it with ``supports_rollout`` (the base check refuses ``rollout`` for one that does not), and the
request's own scheduler must be a first-order flow-matching one (the step reads its ``sigmas``).
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError

#: the scheduler classes whose sigmas a flow SDE step can follow (first-order flow matching)
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)


def check_rollout_scheduler(scheduler_class: str | None, where: str) -> None:
    """Refuse ``rollout`` for a scheduler the flow step cannot follow, naming the field and what is allowed."""
    if scheduler_class not in FLOW_SCHEDULERS:
        raise ConfigError(f"rollout: {where} samples with {scheduler_class or 'an unknown scheduler'}; rollouts need a "
                          f"first-order flow-matching scheduler ({', '.join(FLOW_SCHEDULERS)})", field="rollout")


def flow_step(state: Any, noise_pred: Any, sample: Any, **step_kwargs: Any) -> Any:
    """The next latents of ``state`` from the model's velocity ``noise_pred`` at ``sample`` (the current latents).
    Without a rollout: the request's scheduler step (``step_kwargs`` passed on). With one: the SDE step on the chosen
    steps (ODE elsewhere), drawing from the request's own generator, and the step recorded. Advances neither
    ``step_index`` nor the scheduler's own index (a rollout never calls the scheduler's step)."""
    options = state.sampling_params.rollout
    i = state.step_index
    if options is None:
        return state.scheduler.step(noise_pred, state.timesteps[i], sample, return_dict=False, **step_kwargs)[0]
    from omni_core.pipelines.flow_sde import flow_sde_step

    sigmas = state.scheduler.sigmas
    chosen = options.chosen(i)
    step = flow_sde_step(noise_pred, sample, float(sigmas[i]), float(sigmas[i + 1]),
                         sde_type=options.sde_type if chosen else "ode", noise_level=options.noise_level,
                         sigma_max=float(sigmas[1]) if len(sigmas) > 1 else None, generator=state.generator,
                         with_constant=options.log_prob_constant)
    if chosen:
        record = state.extra.setdefault("rollout", {"steps": [], "log_probs": [], "timesteps": [], "sigmas": [],
                                                    "latents": [], "means": [], "stds": [], "model_outputs": []})
        record["steps"].append(i)
        record["log_probs"].append(step.log_prob.detach().cpu())
        record["timesteps"].append(float(state.timesteps[i]))
        record["sigmas"].append((float(sigmas[i]), float(sigmas[i + 1])))
        if options.trajectory:
            record["latents"].append((sample.detach().float().cpu(), step.prev_sample.detach().cpu()))
        if options.details:
            record["means"].append(step.mean.detach().cpu())
            record["stds"].append(float(step.std))
            record["model_outputs"].append(noise_pred.detach().float().cpu())
    return step.prev_sample.to(sample.dtype)


def rollout_output(state: Any) -> dict | None:
    """What a finished request returns of its rollout (None without one): ``log_probs`` ``[samples, W]`` fp32
    (W chosen steps), ``steps``, ``timesteps`` ``[W]``, ``sigmas`` ``[W, 2]`` (from, to); with ``trajectory``
    ``latents`` ``[samples, W + 1, ...]`` (each chosen step's input, then the last one's output: for a contiguous
    window, the path through it); with ``details`` ``means`` ``[samples, W, ...]``, ``stds`` ``[W]`` and
    ``model_outputs`` ``[samples, W, ...]``."""
    options = getattr(state.sampling_params, "rollout", None)
    if options is None:
        return None
    import torch

    record = state.extra.get("rollout") or {"steps": [], "log_probs": [], "timesteps": [], "sigmas": [],
                                            "latents": [], "means": [], "stds": [], "model_outputs": []}
    n = state.latents.shape[0] if state.latents is not None else 1
    out: dict[str, Any] = {
        "sde_type": options.sde_type, "noise_level": options.noise_level, "steps": list(record["steps"]),
        "log_probs": (torch.stack(record["log_probs"], dim=1) if record["log_probs"]
                      else torch.zeros(n, 0, dtype=torch.float32)),
        "timesteps": torch.tensor(record["timesteps"], dtype=torch.float32),
        "sigmas": torch.tensor(record["sigmas"], dtype=torch.float32).reshape(-1, 2)}
    if options.trajectory and record["latents"]:
        path = [before for before, _ in record["latents"]] + [record["latents"][-1][1]]
        out["latents"] = torch.stack(path, dim=1)
    if options.details and record["means"]:
        out["means"] = torch.stack(record["means"], dim=1)
        out["stds"] = torch.tensor(record["stds"], dtype=torch.float32)
        out["model_outputs"] = torch.stack(record["model_outputs"], dim=1)
    return out


__all__ = ["FLOW_SCHEDULERS", "check_rollout_scheduler", "flow_step", "rollout_output"]
