"""Rollouts through the engine (issue #52): a request with ``rollout`` set samples the chosen steps with a stochastic
flow step and returns, per sample and step, the log-probability of what it drew. Each step's log-prob equals an
independent implementation of the published formula (written here, float64) applied to the trajectory and model
outputs the request returned, on shapes and tiny FLUX.1, Wan and Qwen-Image (one SDE family each, all four
covered); the stored transitions re-score to the same log-probs; the same seed reproduces; a model that does not
step through the core's flow step, or a scheduler it cannot follow, is refused naming ``rollout``."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.errors import OmniError
from omni_core.pipelines.flow_sde import flow_sde_step


def published(v, x, prev, sigma, sigma_next, sigma_max, sde_type, eta):
    """Per-sample log-prob of ``x -> prev`` from the equations (Flow-GRPO ``sde`` / ``cps``, DanceGRPO, ODE)."""
    v, x, prev = v.double(), x.double(), prev.double()
    dt = sigma_next - sigma
    dims = tuple(range(1, x.dim()))
    if sde_type == "sde":
        std_dev_t = (sigma / (1 - (sigma_max if sigma == 1 else sigma))) ** 0.5 * eta
        mean = x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev_t * (-dt) ** 0.5
    elif sde_type == "dance_sde":
        score = -(x - (x - sigma * v) * (1 - sigma)) / sigma ** 2
        mean, std = x + dt * v + (-0.5 * eta ** 2 * score) * dt, eta * (sigma - sigma_next) ** 0.5
    elif sde_type == "cps":
        std = sigma_next * math.sin(eta * math.pi / 2)
        mean = (x - sigma * v) * (1 - sigma_next) + (x + v * (1 - sigma)) * (sigma_next ** 2 - std ** 2) ** 0.5
        return (-((prev - mean) ** 2)).mean(dim=dims)
    else:
        return (-((prev - (x + dt * v)) ** 2)).mean(dim=dims)
    return (-((prev - mean) ** 2) / (2 * std ** 2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean(dim=dims)


def test_log_probs_equal_the_published_formula_and_rescore(case):
    from omni_core import Omni

    name, folder, sde_type, size = case
    rollout = {"sde_type": sde_type, "noise_level": 0.8, "sde_steps": [0, 2, 3], "trajectory": True,
               "details": True}
    fields = dict(num_inference_steps=5, output_type="pt", **size)
    with Omni(folder, warmup=False, cpu_threads=1) as omni:
        out, again = (omni.generate("a red circle", seed=4, use_tqdm=False, rollout=rollout, **fields)[0]
                      for _ in range(2))
    r = out.rollout
    assert r["steps"] == [0, 2, 3] and r["log_probs"].dtype == torch.float32
    assert r["log_probs"].shape == (out.tensor.shape[0], 3) and torch.isfinite(r["log_probs"]).all()
    assert torch.equal(again.rollout["log_probs"], r["log_probs"]) and torch.equal(again.tensor, out.tensor)
    latents, outputs = r["latents"], r["model_outputs"]
    sigma_max = float(r["sigmas"][0][1])  # step 0 is chosen: its (from, to) are the schedule's first two sigmas
    checked = 0
    for w, step in enumerate(r["steps"]):
        sigma, sigma_next = (float(s) for s in r["sigmas"][w])
        x = latents[:, w]
        # what the step drew: the trajectory's next entry where that is its output (the next chosen step is the
        # next step, or this is the last chosen one); step 0 -> 1 is not (step 1 ran the ODE)
        last = w == len(r["steps"]) - 1
        if not (last or r["steps"][w + 1] == step + 1):
            continue
        prev = latents[:, w + 1]
        checked += 1
        want = published(outputs[:, w], x, prev, sigma, sigma_next, sigma_max, sde_type, 0.8)
        assert torch.allclose(r["log_probs"][:, w].double(), want, atol=1e-5), (name, step)
        rescored = flow_sde_step(outputs[:, w], x, sigma, sigma_next, sde_type=sde_type, noise_level=0.8,
                                 sigma_max=sigma_max, prev_sample=prev)
        assert torch.allclose(rescored.log_prob, r["log_probs"][:, w], atol=1e-5)
    assert checked == 2


def test_a_model_off_the_flow_step_is_refused_naming_rollout(tiny_dit_model):
    from omni_core import Omni

    with Omni(tiny_dit_model, warmup=False, cpu_threads=1) as omni:
        with pytest.raises(OmniError) as err:
            omni.generate("a cat", rollout=True, num_inference_steps=2, use_tqdm=False)
    assert err.value.field == "rollout" and "supports_rollout" in str(err.value)


def test_a_rollout_with_the_decode_stage_apart_equals_in_line():
    """The rollout record is the model process's; with ``decode_workers=1`` the caller still gets it, and the same
    bits (with batch-invariant waves and step mode on, as an RL sampler would run)."""
    from omni_core import Omni

    outs = []
    for decode_workers in (0, 1):
        with Omni("shapes", warmup=False, cpu_threads=1, decode_workers=decode_workers, step_execution=True,
                  batch_invariant=True) as omni:
            outs.append(omni.generate("a red circle", seed=1, output_type="pt", use_tqdm=False, num_inference_steps=4,
                                      num_outputs_per_prompt=2, rollout={"trajectory": True})[0])
    inline, apart = outs
    assert torch.equal(apart.tensor, inline.tensor)
    assert torch.equal(apart.rollout["log_probs"], inline.rollout["log_probs"])
    assert torch.equal(apart.rollout["latents"], inline.rollout["latents"])
