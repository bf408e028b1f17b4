"""``DiffusersStepPipeline`` helpers a model plugin relies on (author gaps of 2026-12-06)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


class _Plain(torch.nn.Module):
    """A denoiser without diffusers' CacheMixin (no ``cache_context``): a third party's own transformer."""

    def forward(self, hidden_states, return_dict=False):
        return (hidden_states * 2,)


def test_call_denoiser_runs_a_transformer_without_diffusers_cache_mixin():
    from omni_core.pipelines.diffusers_step import DiffusersStepPipeline
    from omni_core.pipelines.state import StepState
    from omni_core.request import OmniDiffusionRequest

    pipeline = DiffusersStepPipeline.__new__(DiffusersStepPipeline)
    pipeline.experts = {"transformer": _Plain()}
    states = [StepState(request=OmniDiffusionRequest(prompt=p), latents=torch.ones(1, 4)) for p in ("a", "b")]
    x = torch.arange(8.0).reshape(2, 4)
    out = pipeline.call_denoiser("transformer", [(s, "cond") for s in states], hidden_states=x)
    assert [o.tolist() for o in out] == [[[0.0, 2.0, 4.0, 6.0]], [[8.0, 10.0, 12.0, 14.0]]]
