"""The flow SDE step with log-probabilities (``omni_core.pipelines.flow_sde``, issue #52's sampling math) against an
independent implementation of each published formula written here (Flow-GRPO's ``sde`` and ``cps``, DanceGRPO's
``dance_sde``, the ODE), against torch's own Normal density, and re-scoring: a stored transition scores to the
log-prob it was drawn with."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.errors import ConfigError
from omni_core.pipelines.flow_sde import flow_sde_step

SIGMAS = [1.0, 0.9, 0.75, 0.5, 0.2, 0.0]


def reference(v, x, sigma, sigma_next, sigma_max, sde_type, eta, eps):
    """(mean, std) from the equations as the papers' code writes them, elementwise in float64."""
    v, x = v.double(), x.double()
    dt = sigma_next - sigma
    if sde_type == "sde":
        s = sigma_max if sigma == 1 else sigma
        std_dev_t = (sigma / (1 - s)) ** 0.5 * eta
        mean = x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, std_dev_t * (-dt) ** 0.5
    if sde_type == "cps":
        std_dev_t = sigma_next * math.sin(eta * math.pi / 2)
        pred_x0 = x - sigma * v
        pred_x1 = x + v * (1 - sigma)
        return pred_x0 * (1 - sigma_next) + pred_x1 * (sigma_next ** 2 - std_dev_t ** 2) ** 0.5, std_dev_t
    if sde_type == "dance_sde":
        pred_x0 = x - sigma * v
        score = -(x - pred_x0 * (1 - sigma)) / sigma ** 2
        return x + dt * v + (-0.5 * eta ** 2 * score) * dt, eta * (sigma - sigma_next) ** 0.5
    return x + dt * v, 0.0


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde", "ode"])
@pytest.mark.parametrize("i", [0, 2, 3])
def test_each_step_equals_the_published_formula(sde_type, i):
    g = torch.Generator().manual_seed(i)
    x, v = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    sigma, sigma_next, eta = SIGMAS[i], SIGMAS[i + 1], 0.7
    step = flow_sde_step(v, x, sigma, sigma_next, sde_type=sde_type, noise_level=eta, sigma_max=SIGMAS[1],
                         generator=torch.Generator().manual_seed(7))
    mean, std = reference(v, x, sigma, sigma_next, SIGMAS[1], sde_type, eta, None)
    assert torch.allclose(step.mean.double(), mean, atol=1e-5) and abs(float(step.std) - std) < 1e-6
    eps = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    prev = mean + std * eps.double()
    assert torch.allclose(step.prev_sample.double(), prev, atol=1e-5)
    if sde_type in ("cps", "ode"):
        want = (-((prev - mean) ** 2)).mean(dim=(1, 2, 3))
    else:
        want = (-((prev - mean) ** 2) / (2 * std ** 2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean(
            dim=(1, 2, 3))
    assert step.log_prob.dtype == torch.float32 and step.log_prob.shape == (3,)
    assert torch.allclose(step.log_prob.double(), want, atol=1e-5)


def test_the_gaussian_log_prob_is_torchs_normal_density_and_without_its_constant_the_quadratic():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)
    step = flow_sde_step(v, x, 0.75, 0.5, sde_type="sde", noise_level=0.9, generator=g)
    normal = torch.distributions.Normal(step.mean, step.std)
    assert torch.allclose(step.log_prob, normal.log_prob(step.prev_sample).mean(dim=1), atol=1e-5)
    bare = flow_sde_step(v, x, 0.75, 0.5, sde_type="sde", noise_level=0.9, prev_sample=step.prev_sample,
                         with_constant=False)
    assert torch.allclose(bare.log_prob, step.log_prob + math.log(float(step.std)) + 0.5 * math.log(2 * math.pi),
                          atol=1e-5)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_a_stored_transition_rescores_to_its_log_prob(sde_type):
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(4, 3, 6, generator=g), torch.randn(4, 3, 6, generator=g)
    drawn = flow_sde_step(v, x, 0.9, 0.75, sde_type=sde_type, generator=torch.Generator().manual_seed(5))
    again = flow_sde_step(v, x, 0.9, 0.75, sde_type=sde_type, prev_sample=drawn.prev_sample)
    assert torch.equal(again.log_prob, drawn.log_prob)
    other = flow_sde_step(v, x, 0.9, 0.75, sde_type=sde_type, prev_sample=drawn.prev_sample + 0.5)
    assert (other.log_prob < drawn.log_prob).all()


def test_the_draws_have_the_steps_mean_and_std():
    x, v = torch.zeros(1, 200_000), torch.ones(1, 200_000)
    step = flow_sde_step(v, x, 0.75, 0.5, sde_type="dance_sde", noise_level=0.8,
                         generator=torch.Generator().manual_seed(3))
    residual = step.prev_sample - step.mean
    assert abs(residual.mean().item()) < 0.01 and abs(residual.std().item() / float(step.std) - 1) < 0.01


def test_an_unknown_sde_type_is_refused_naming_the_field_and_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        flow_sde_step(torch.ones(1, 2), torch.ones(1, 2), 0.5, 0.2, sde_type="sdee")
    assert err.value.field == "sde_type" and "sde, cps, dance_sde, ode" in str(err.value)
