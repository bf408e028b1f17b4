"""Streamed previews on the diffusers backend: one RGB preview per step (a UNet's latents, FLUX's packed ones, a
video's), then the final output, from the step-end callback in request mode (SD: no modular blocks) or from the
modular blocks' steps in step mode (FLUX.1, Wan); ``preview_count`` (OpenAI's partial_images) spreads fewer over the steps."""

from __future__ import annotations

import pytest

from omni_model_diffusers.parity import omni_fields
from omni_model_diffusers.testing import FAMILIES


def _stream(omni, name, **request):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    fields = {**omni_fields(FAMILIES[name].call_kwargs), "num_inference_steps": 4}
    req = OmniDiffusionRequest(prompt="a cat", sampling_params=SamplingParams(seed=1, output_type="pt", **fields),
                               **request)
    (stream,) = omni.engine.submit([req])
    outs = [stream.get(timeout=120)]
    while not outs[-1].finished:
        outs.append(stream.get(timeout=120))
    return outs


@pytest.mark.parametrize("name", ["sd", "flux", "wan"])
def test_one_preview_per_step_then_the_image(family, name):
    from omni_core import Omni

    with Omni(family(name), pipeline="diffusers", warmup=False, cpu_threads=1, streaming_output=True) as omni:
        # a family diffusers offers as modular blocks streams in step mode (tier 2), another from its own call
        tier2 = omni.engine.pipeline_cls.supports_step_execution
        assert omni.engine.mode.mode.value == ("step_batch" if tier2 else "request_batch")
        outs = _stream(omni, name)
        partial = _stream(omni, name, preview_count=2)
    assert [o.finished for o in outs] == [False] * 4 + [True] and outs[-1].status == "completed"
    assert [o.step_index for o in outs[:-1]] == [1, 2, 3, 4]
    for o in outs[:-1]:
        assert o.preview.dim() == 3 and o.preview.shape[0] == 3
        assert 0 <= float(o.preview.min()) and float(o.preview.max()) <= 1
    assert not all(outs[0].preview.equal(o.preview) for o in outs[1:-1])  # each step's own latents
    assert len([o for o in partial if o.preview is not None]) == 2
