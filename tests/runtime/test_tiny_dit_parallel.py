"""The tiny DiT's declared ``sp_plan`` shards it: Ulysses-2 and Ring-2 over gloo (spawned workers, which find
the session's entry point) give the one-process image."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _image(model, **config):
    from omni_core import Omni

    with Omni(model, warmup=False, **config) as omni:
        (out,) = omni.generate("a red square", seed=5, num_inference_steps=3, output_type="pt", use_tqdm=False)
    assert out.status == "completed"
    return out.images[0]


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, {"ring_degree": 2}], ids=["ulysses2", "ring2"])
def test_sequence_parallel_matches_one_process(tiny_dit_model, degrees):
    reference = _image(tiny_dit_model)
    sharded = _image(tiny_dit_model, parallel_config=degrees)
    torch.testing.assert_close(sharded, reference, atol=1e-5, rtol=1e-5)
