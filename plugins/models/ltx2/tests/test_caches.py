"""Both cache backends work on LTX-2 by its DenoiserSpec alone (two carried streams, video and audio): with the
shipped defaults (``omni_model_ltx2.denoiser``: ``TEACACHE_DEFAULTS`` fitted on this tiny folder,
``CACHE_DIT_DEFAULTS``), fewer evaluations of the last block and >= 30 dB PSNR of the video against uncached, for
a wave of three requests with CFG and STG rows (each branch's cache state apart: ``RowGroup.branch``; modality rows
off: see the README's "Not done") over 12 steps."""

from __future__ import annotations

import pytest

from omni_core.testing import enabled_cache_backend, make_state, psnr, run_request_batch

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", 'a sign that reads "OPEN"']
STEPS = 12
GUIDANCE = {"guidance_scale": 3.0, "audio_guidance_scale": 5.0, "stg_scale": 1.0, "audio_stg_scale": 1.0,
            "modality_scale": 1.0, "audio_modality_scale": 1.0}


def states(pipeline):
    return [make_state(pipeline, p, seed=3 + i, negative_prompt="blurry", height=32, width=32, num_frames=9,
                       num_inference_steps=STEPS, max_sequence_length=64, **GUIDANCE) for i, p in enumerate(PROMPTS)]


def counted(pipeline, backend):
    """(video outputs, audio outputs, rows the last block's video feed-forward computed: the caches wrap the
    blocks' forward, so a hook on the block itself would count skipped calls too)."""
    import torch

    rows = []
    hook = pipeline.pipe.transformer.transformer_blocks[-1].ff.register_forward_pre_hook(
        lambda m, a: rows.append(a[0].shape[0]))
    try:
        with torch.inference_mode():
            if backend is None:
                outs = run_request_batch(pipeline, states(pipeline))
            else:
                with enabled_cache_backend(backend, pipeline) as b:
                    outs = run_request_batch(pipeline, states(pipeline), cache_backend=b)
        return [o.tensor for o in outs], [o.audio for o in outs], sum(rows)
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def uncached(omni_ltx2):
    return counted(omni_ltx2, None)


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(omni_ltx2, uncached, backend):
    from omni_core.plugins import get_plugin_manager

    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    plain, plain_audio, plain_rows = uncached
    assert plain_rows == 3 * len(PROMPTS) * STEPS  # cond, uncond and STG rows, every step
    cached, audio, rows = counted(omni_ltx2, backend)
    assert rows < plain_rows, f"{backend} computed every row"
    dbs = [psnr(a, b) for a, b in zip(plain, cached)]
    # the waveform spans [-1, 1]: peak 2
    audio_dbs = [psnr(a, b, peak=2.0) for a, b in zip(plain_audio, audio)]
    print(f"{backend}: {rows} of {plain_rows} rows computed, video PSNR {min(dbs):.1f}-{max(dbs):.1f} dB, "
          f"audio {min(audio_dbs):.1f}-{max(audio_dbs):.1f} dB")
    assert min(dbs) >= 30, f"{backend}: video PSNR {min(dbs):.1f} dB against uncached"
    assert min(audio_dbs) >= 30, f"{backend}: audio PSNR {min(audio_dbs):.1f} dB against uncached"
