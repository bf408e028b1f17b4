"""``DiffusersParityContract`` on the core's tiny DiT: the real pipeline passes it, and pipelines with a bug the
contract exists for fail its checks (a CFG formula off by one, the seed ignored, batch rows that see each other).

The tiny DiT has no diffusers twin, so the reference is the unmodified pipeline run one prompt per call behind
diffusers' calling convention (``prompt=``, ``generator=``, ``callback_on_step_end=``, ``.images``-first
output); the broken pipelines are small subclasses of the real one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_core.testing import DiffusersParityContract, load_model, make_state, run_step_batch
from omni_core.testing.tiny_dit import TinyDiTPipeline


class TinyDiTReference:
    """diffusers' calling convention over the unmodified tiny DiT, one prompt per call."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def __call__(self, prompt: str, *, negative_prompt: str | None, generator: torch.Generator, output_type: str,
                 callback_on_step_end: Any, num_images_per_prompt: int = 1, **fields: Any) -> tuple:
        assert output_type == "pt"
        state = make_state(self.pipeline, prompt, negative_prompt=negative_prompt,
                           num_outputs_per_prompt=num_images_per_prompt, **fields)
        state.generator = generator
        (out,) = run_step_batch(self.pipeline, [state])
        callback_on_step_end(self, state.step_index - 1, None, {"latents": state.latents})
        return (out.tensor,)


class TestTinyDiTParity(DiffusersParityContract):
    pipeline_class = "OmniTinyDiTPipeline"
    model_fixture = "tiny_dit_model"
    sampling = {"num_inference_steps": 3}
    prompts = ("a red square in the top left corner", "two dots", "a blue circle on the left")
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 4.0, 1.0
    other_size = {"width": 24}
    non_square = {"height": 24, "width": 16}

    @classmethod
    def load_reference(cls, model_path: str) -> Any:
        return TinyDiTReference(load_model(model_path))


class CfgOffByOne(TinyDiTPipeline):
    """Guidance as ``uncond + (scale + 1) * (cond - uncond)``."""

    def denoise_step(self, states):
        guided = [s for s in states if s.extra["guidance_scale"] > 1.0]
        for s in guided:
            s.extra["guidance_scale"] += 1
        try:
            return super().denoise_step(states)
        finally:
            for s in guided:
                s.extra["guidance_scale"] -= 1


class IgnoresTheSeed(TinyDiTPipeline):
    """Draws every request's noise from one fixed generator."""

    def prepare_encode(self, state):
        state.generator = torch.Generator("cpu").manual_seed(0)
        return super().prepare_encode(state)


class RowsSeeEachOther(TinyDiTPipeline):
    """Adds the mean of the whole wave's predictions to each request's (alone: unchanged)."""

    def denoise_step(self, states):
        preds = super().denoise_step(states)
        if len(preds) < 2:
            return preds
        mean = torch.stack([p.mean() for p in preds]).mean()
        return [p + mean for p in preds]


class OneCallPerBranch(TinyDiTPipeline):
    """Right results, but every request and CFG branch of a wave as a transformer call of its own."""

    def _run(self, segments):
        return [out for seg in segments for out in TinyDiTPipeline._run(self, [seg])]


C = TestTinyDiTParity
BROKEN = {
    "cfg-off-by-one": (CfgOffByOne, [lambda c: c.test_request_batch_matches_diffusers(cfg="on"),
                                     C.test_step_mode_staggered_matches_diffusers,
                                     C.test_several_outputs_non_square_matches_diffusers]),
    "ignores-the-seed": (IgnoresTheSeed, [lambda c: c.test_request_batch_matches_diffusers(cfg="off"),
                                          lambda c: c.test_request_batch_matches_diffusers(cfg="on"),
                                          C.test_step_mode_staggered_matches_diffusers,
                                          C.test_several_outputs_non_square_matches_diffusers]),
    "rows-see-each-other": (RowsSeeEachOther, [lambda c: c.test_request_batch_matches_diffusers(cfg="off"),
                                               C.test_step_mode_staggered_matches_diffusers,
                                               C.test_a_wave_is_one_call_per_step_and_equals_each_alone]),
}


@pytest.fixture(scope="module")
def reference(tiny_dit_model: str) -> TinyDiTReference:
    return TestTinyDiTParity.load_reference(tiny_dit_model)


@pytest.mark.parametrize("bug", sorted(BROKEN))
def test_the_contract_fails_a_broken_pipeline(tiny_dit_model, reference, bug):
    cls, checks = BROKEN[bug]
    pipeline = load_model(tiny_dit_model)
    pipeline.__class__ = cls  # the real loader's pipeline, with the bug
    contract = TestTinyDiTParity().bind(tiny_dit_model, pipeline, reference)
    for check in checks:
        with pytest.raises(AssertionError):
            check(contract)


def test_a_correct_pipeline_with_unfolded_branches_breaks_the_one_call_per_wave_check(tiny_dit_model, reference):
    """Each CFG branch as a call of its own: the results are right, the batch shape is not."""

    pipeline = load_model(tiny_dit_model)
    pipeline.__class__ = OneCallPerBranch
    contract = TestTinyDiTParity().bind(tiny_dit_model, pipeline, reference)
    with pytest.raises(AssertionError, match="denoiser calls"):
        contract.test_a_wave_is_one_call_per_step_and_equals_each_alone()
    contract.test_several_outputs_non_square_matches_diffusers()  # the output itself is still right


def test_make_states_seeds_each_request_and_takes_lists_per_request(tiny_dit):
    from omni_core.testing import make_states

    states = make_states(tiny_dit, ["a", "b", "c"], seed=5, num_inference_steps=[2, 3, 4], negative_prompt="")
    assert [s.request.prompt for s in states] == ["a", "b", "c"]
    assert [s.request.sampling_params.seed for s in states] == [5, 6, 7]
    assert [s.request.sampling_params.num_inference_steps for s in states] == [2, 3, 4]
    assert {s.request.negative_prompt for s in states} == {""}
    with pytest.raises(ValueError, match="num_inference_steps has 2 values for 3 prompts"):
        make_states(tiny_dit, ["a", "b", "c"], num_inference_steps=[2, 3])
