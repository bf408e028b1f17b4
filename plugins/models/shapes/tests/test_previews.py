"""The shapes model's previews (issue #37): the shipped projection is exact ((x + 1) / 2 of the clean estimate),
so a mid-run preview equals the final output's formula applied to that step's clean estimate."""

from __future__ import annotations

import torch

from omni_core.config import SamplingParams
from omni_core.pipelines.state import StepState, flow_clean_estimate
from omni_core.request import OmniDiffusionRequest
from omni_core.testing.previews import check_shipped_projections


def test_preview_is_the_clean_estimate_in_pixels(shapes_pipeline):
    p = shapes_pipeline
    params = type(p).check_sampling_params(SamplingParams(num_inference_steps=4, seed=3), None)
    state = StepState(request=OmniDiffusionRequest(prompt="a red circle in the top left", sampling_params=params),
                      generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        with p.encoded_prompts([state]):
            p.prepare_encode(state)
        assert p.preview(state) is None  # no step yet: nothing estimated
        for _ in range(2):
            (pred,) = p.denoise_step([state])
            p.step_scheduler(state, pred)
        shown = p.preview(state)
    want = ((flow_clean_estimate(state)[0] + 1) / 2).clamp(0, 1)
    assert shown.shape == want.shape and torch.allclose(shown, want, atol=1e-6)


def test_the_shipped_projection_is_for_every_shapes_folder(shapes_pipeline):
    (proj,) = check_shipped_projections(shapes_pipeline, expect_match=True)
    assert proj.weight == ((0.5, 0.0, 0.0), (0.0, 0.5, 0.0), (0.0, 0.0, 0.5)) and proj.bias == (0.5, 0.5, 0.5)
