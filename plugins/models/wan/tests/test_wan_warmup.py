"""The engine's start-up warm-up on a tiny Wan 2.2 folder (two experts, RoPE table of 32 positions).

At Wan's default size (480x832, 81 frames: 52 latent positions along the width) the warm-up could not run on
this valid small model; it now runs one step at the smallest valid shape, so the model loads and generates
with the warm-up on.
"""

from __future__ import annotations

from omni_core import Omni


def test_tiny_wan22_loads_and_runs_with_the_warmup_on(wan22_dir):
    with Omni(wan22_dir, dtype="float32") as omni:  # warmup=True is the default
        params = omni.engine.warmup_params()
        assert (params.height, params.width, params.num_frames, params.num_inference_steps) == (16, 16, 1, 1)
        assert omni.stats()["requests_completed"] == 1  # the warm-up ran
        (out,) = omni.generate("a cat", height=16, width=32, num_frames=5, num_inference_steps=2, seed=0,
                               use_tqdm=False)
    assert out.status == "completed"
    assert len(out.frames) == 1 and len(out.frames[0]) == 5 and out.frames[0][0].size == (32, 16)
