"""HunyuanVideo 1.5 under the engine's options, each against one shared in-line engine (``plain``: float32, one torch
thread) on the tiny text-to-video folder, with CFG on and two prompts of different lengths (one with ByT5 glyph text) per generate:

* **offload** ``"model"`` and ``"group"`` give those videos bit for bit;
* **stages apart** (``encode_workers=1``, ``decode_workers=1``: both text encoders and the VAE in processes of their
  own; the contract's ``test_stages_apart_equal_in_line``, on this engine's in-line videos) give them bit for
  bit, and the model process holds neither text encoder nor the VAE;
* **int8** weight-only quantization of the transformer: smaller, close to float32, not equal;
* **a LoRA per request**: diffusers has no LoRA loader for HunyuanVideo 1.5's pipelines, so the adapter (diffusers'
  own naming, as the transformer's ``save_lora_adapter`` writes it) loads through the transformer's PEFT mixin; in
  one wave the request with the adapter equals itself alone and moves away from no adapter, the other stays the
  plain video.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams

#: both with a negative prompt: whether a request has one is part of the scheduler's batch key, so only such a
#: pair shares transformer calls (the LoRA test's mixed wave)
PROMPTS = [{"prompt": "a red fox jumps over a lazy dog", "negative_prompt": "blurry, low quality"},
           {"prompt": 'a neon sign that reads "OPEN"', "negative_prompt": "dark"}]
FIELDS = dict(height=16, width=16, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=5, output_type="pt")
ENGINE = dict(warmup=False, cpu_threads=1, max_num_seqs=2)


def generate(omni) -> list[torch.Tensor]:
    outs = omni.generate(PROMPTS, SamplingParams(**FIELDS), use_tqdm=False)
    assert all(o.status == "completed" for o in outs), [o.error for o in outs]
    return [torch.stack([torch.as_tensor(f) for f in o.images[0]]) if isinstance(o.images[0], list) else o.images[0]
            for o in outs]


@pytest.fixture(scope="module")
def plain(hv_dir) -> dict:
    from omni_core import Omni

    with Omni(hv_dir, **ENGINE) as omni:
        return {"wave": generate(omni), "bytes": omni.stats()["model_bytes"]}


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_equals_no_offload(hv_dir, plain, mode):
    from omni_core import Omni

    with Omni(hv_dir, offload=mode, **ENGINE) as omni:
        wave = generate(omni)
    for got, want in zip(wave, plain["wave"]):
        assert torch.equal(got, want)


def test_stages_apart_equal_in_line(hv_dir, plain):
    from omni_core import Omni

    with Omni(hv_dir, encode_workers=1, decode_workers=1, **ENGINE) as omni:
        wave = generate(omni)
        held = set(omni.stats()["model_bytes"])
    assert not held & {"text_encoder", "text_encoder_2", "vae"} and "transformer" in held, held
    for got, want in zip(wave, plain["wave"]):
        assert torch.equal(got, want)


def test_int8_shrinks_the_transformer_and_stays_close(hv_dir, plain):
    pytest.importorskip("torchao")
    from omni_core import Omni

    with Omni(hv_dir, quantization="int8", **ENGINE) as omni:
        wave = generate(omni)
        after = omni.stats()["model_bytes"]
    before = plain["bytes"]
    assert after["transformer"] < 0.75 * before["transformer"], (before, after)
    assert after["vae"] == before["vae"] and after["text_encoder"] == before["text_encoder"]
    diff = max((g - w).abs().max().item() for g, w in zip(wave, plain["wave"]))
    print(f"int8 transformer {after['transformer']} of {before['transformer']} bytes, max |diff| {diff:.2e}")
    assert 0 < diff < 0.05


def test_a_lora_per_request_through_the_transformers_own_adapter_loader(hv_dir, plain, tmp_path):
    pytest.importorskip("peft")
    from omni_core import Omni
    from omni_core.lora.testing import make_lora

    adapter = make_lora(hv_dir, str(tmp_path / "lora"), rank=4, seed=3, std=0.5, targets=("to_q", "to_k", "to_v"))
    with_lora = SamplingParams(**FIELDS, lora=adapter)
    with Omni(hv_dir, max_lora_rank=8, **ENGINE) as omni:
        outs = omni.generate(PROMPTS, [with_lora, SamplingParams(**FIELDS)], use_tqdm=False)
        (alone,) = omni.generate(PROMPTS[:1], with_lora, use_tqdm=False)
    assert all(o.status == "completed" for o in [*outs, alone]), [o.error for o in [*outs, alone]]
    mixed, plain_row, alone = (torch.stack([torch.as_tensor(f) for f in o.images[0]]) for o in [*outs, alone])
    assert torch.equal(plain_row, plain["wave"][1])
    assert (mixed - alone).abs().max() <= 1e-5
    assert (mixed - plain["wave"][0]).abs().max() > 1e-2
