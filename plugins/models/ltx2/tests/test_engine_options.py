"""LTX-2 under the engine's options, each against the session's shared in-line engine (``ltx2_engines()``: float32,
one torch thread, request mode) on the tiny text-to-video folder, with CFG on and two prompts of different lengths:

* **offload** ``"model"`` and ``"group"`` give those videos and sound tracks bit for bit;
* **int8** weight-only quantization of the transformer: smaller, close to float32 (video and audio), not equal;
* **a LoRA per request**: the adapter (diffusers' own naming, as the transformer's ``save_lora_adapter`` writes
  it) on the video and audio attentions' projections; in one step-mode wave (the two requests' rows in the same
  transformer calls) the request with the adapter equals itself alone and moves away from no adapter, the other
  stays the plain output.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams

#: both with a negative prompt: whether a request has one is part of the scheduler's batch key, so only such a
#: pair shares transformer calls (the LoRA test's mixed wave)
PROMPTS = [{"prompt": "a red fox jumps over a lazy dog", "negative_prompt": "blurry, low quality"},
           {"prompt": "a cat", "negative_prompt": "dark"}]
FIELDS = dict(height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=4.0, stg_scale=0.0,
              audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, max_sequence_length=64, seed=5,
              output_type="pt")
ENGINE = dict(warmup=False, cpu_threads=1, max_num_seqs=2)


def outputs(outs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    assert all(o.status == "completed" for o in outs), [o.error for o in outs]
    return [(torch.as_tensor(o.images[0]) if not isinstance(o.images[0], list)
             else torch.stack([torch.as_tensor(f) for f in o.images[0]]), torch.as_tensor(o.audio)) for o in outs]


def generate(omni, params=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return outputs(omni.generate(PROMPTS, params or SamplingParams(**FIELDS), use_tqdm=False))


@pytest.fixture(scope="module")
def plain(ltx2_engines) -> dict:
    omni = ltx2_engines(max_num_seqs=2)
    return {"wave": generate(omni), "bytes": omni.stats()["model_bytes"]}


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_equals_no_offload(ltx2_dir, plain, mode):
    from omni_core import Omni

    with Omni(ltx2_dir, offload=mode, **ENGINE) as omni:
        wave = generate(omni)
    for (video, audio), (want_video, want_audio) in zip(wave, plain["wave"]):
        assert torch.equal(video, want_video) and torch.equal(audio, want_audio)


def test_int8_shrinks_the_transformer_and_stays_close(ltx2_dir, plain):
    pytest.importorskip("torchao")
    from omni_core import Omni

    with Omni(ltx2_dir, quantization="int8", **ENGINE) as omni:
        wave = generate(omni)
        after = omni.stats()["model_bytes"]
    before = plain["bytes"]
    assert after["transformer"] < 0.75 * before["transformer"], (before, after)
    assert after["vae"] == before["vae"] and after["text_encoder"] == before["text_encoder"]
    video = max((g[0] - w[0]).abs().max().item() for g, w in zip(wave, plain["wave"]))
    audio = max((g[1] - w[1]).abs().max().item() for g, w in zip(wave, plain["wave"]))
    print(f"int8 transformer {after['transformer']} of {before['transformer']} bytes; max |diff| video {video:.2e}, "
          f"audio {audio:.2e}")
    assert 0 < video < 0.05 and audio < 0.05


def test_a_lora_per_request(ltx2_dir, ltx2_engines, plain, tmp_path):
    pytest.importorskip("peft")
    from omni_core import Omni
    from omni_core.lora.testing import make_lora

    adapter = make_lora(ltx2_dir, str(tmp_path / "lora"), rank=4, seed=3, std=0.5, targets=("to_q", "to_k", "to_v"))
    with_lora = SamplingParams(**FIELDS, lora=adapter)
    # step mode: the second request joins the first's wave at the next step at the latest (in request mode the
    # first can start alone before the second is submitted, and each would run in calls of its own)
    with Omni(ltx2_dir, max_lora_rank=8, step_execution=True, **ENGINE) as omni:
        (mixed, plain_row) = outputs(omni.generate(PROMPTS, [with_lora, SamplingParams(**FIELDS)], use_tqdm=False))
        (alone,) = outputs(omni.generate(PROMPTS[:1], with_lora, use_tqdm=False))
    assert torch.equal(plain_row[0], plain["wave"][1][0]) and torch.equal(plain_row[1], plain["wave"][1][1])
    assert (mixed[0] - alone[0]).abs().max() <= 1e-5 and (mixed[1] - alone[1]).abs().max() <= 1e-5
    assert (mixed[0] - plain["wave"][0][0]).abs().max() > 1e-2  # the adapter moves the video
    assert (mixed[1] - plain["wave"][0][1]).abs().max() > 0  # and the sound (the tiny audio barely depends on it)
