"""FLUX.2 [klein] under the engine's options, each against one shared in-line engine (``plain``: float32, the
adapter preloaded, one torch thread), on the tiny folder with CFG on (cond and uncond rows both carry the adapter):

* **per-request LoRA** (docs/lora.md): a diffusers-format adapter (peft, ``save_lora_weights``) on the joint
  attention, the fused single-stream projection and the MLPs; a wave holding a request with it and one without
  equals each run alone, and the adapter changes the image;
* **offload** ``"model"`` gives that wave bit for bit (the adapter's layers move with the transformer);
* **the decode stage apart** (``decode_workers=1``: a VAE process of its own, which rebuilds the latent ids from
  the plain ints of the state, all it gets) gives the plain request bit for bit: what the contract's
  ``test_stages_apart_equal_in_line`` checks, on this engine's in-line images and with one process instead of
  three (the encode stage apart is the core's transport around the same ``encode_prompts`` the in-line text window
  calls; the model process keeps the VAE either way: it encodes reference images);
* **int8** weight-only quantization of the transformer: smaller, close to float32, not equal.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams

PROMPT = {"prompt": "a red fox jumps over a lazy dog", "negative_prompt": "blurry, low quality"}
FIELDS = dict(height=16, width=16, num_inference_steps=2, max_sequence_length=48, guidance_scale=4.0, seed=5,
              output_type="pt")
#: peft target names: the double-stream joint attention (image and text side), the single-stream fused
#: [q | k | v | gate | up] projection and the double-stream MLPs' fused [gate | up]
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "to_qkv_mlp_proj", "linear_in")
ENGINE = dict(warmup=False, cpu_threads=1, max_num_seqs=2)


def levels(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a * 255).round() - (b * 255).round()).abs().max().item()


def generate(omni, loras: list) -> list:
    """One ``generate`` (one wave when the engine batches them): a request per entry, with that adapter or none."""
    outs = omni.generate([PROMPT] * len(loras), [SamplingParams(**FIELDS, lora=name) for name in loras],
                         use_tqdm=False)
    assert all(o.status == "completed" for o in outs), [o.error for o in outs]
    return outs


@pytest.fixture(scope="module")
def lora(klein_dir, tmp_path_factory) -> str:
    pytest.importorskip("peft")
    from omni_core.lora.testing import make_lora

    return make_lora(klein_dir, str(tmp_path_factory.mktemp("flux2-lora")), rank=4, std=0.5, targets=TARGETS)


@pytest.fixture(scope="module")
def plain(klein_dir, lora) -> dict:
    """The in-line engine's images: ``wave`` (styled, plain in one wave), ``styled`` and ``plain`` each alone."""
    from omni_core import Omni

    with Omni(klein_dir, loras={"style": lora}, max_lora_rank=8, **ENGINE) as omni:
        wave = generate(omni, ["style", None])
        assert [o.metrics["batch_size"] for o in wave] == [2, 2], "one wave"
        (styled,) = generate(omni, ["style"])
        (alone,) = generate(omni, [None])
        return {"wave": [o.images[0] for o in wave], "styled": styled.images[0], "plain": alone.images[0],
                "bytes": omni.stats()["model_bytes"]}


def test_lora_per_request_in_one_wave_equals_each_alone(plain):
    styled, base = plain["wave"]
    torch.testing.assert_close(styled, plain["styled"], atol=1e-4, rtol=0)  # batching: summation order only
    torch.testing.assert_close(base, plain["plain"], atol=1e-4, rtol=0)
    print(f"LoRA wave vs alone: {(styled - plain['styled']).abs().max().item():.1e} (styled), "
          f"{(base - plain['plain']).abs().max().item():.1e} (plain); the adapter moves the image "
          f"{levels(styled, base):.0f} levels of 255")
    assert levels(styled, base) >= 3, "the adapter changes the image"


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_equals_no_offload_with_the_adapter(klein_dir, lora, plain, mode):
    """``group`` offloads diffusers' block lists one block at a time (the plugin's ``omni_blocks`` wrappers call
    those blocks, so their hooks run)."""
    from omni_core import Omni

    with Omni(klein_dir, loras={"style": lora}, max_lora_rank=8, offload=mode, **ENGINE) as omni:
        wave = generate(omni, ["style", None])
    for got, want in zip(wave, plain["wave"]):
        assert torch.equal(got.images[0], want)


def test_decode_apart_equals_in_line(klein_dir, plain):
    import os

    from omni_core import Omni

    with Omni(klein_dir, decode_workers=1, **ENGINE) as omni:
        (out,) = generate(omni, [None])
        decode = omni.stats()["stages"]["decode"]
    assert decode["done"] == 1 and decode["pid"] != os.getpid() and "vae" in decode["model_bytes"], decode
    assert torch.equal(out.images[0], plain["plain"])


def test_int8_shrinks_the_transformer_and_stays_close(klein_dir, plain):
    pytest.importorskip("torchao")
    import math
    import os

    from safetensors import safe_open

    from omni_core import Omni

    with Omni(klein_dir, quantization="int8", **ENGINE) as omni:
        (out,) = generate(omni, [None])
        after = omni.stats()["model_bytes"]
    before = plain["bytes"]  # its transformer holds the adapter too: the float32 size is the folder's
    with safe_open(os.path.join(klein_dir, "transformer", "diffusion_pytorch_model.safetensors"), "pt") as f:
        full = sum(4 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert after["transformer"] <= 0.35 * full, (full, after)
    assert after["vae"] == before["vae"] and after["text_encoder"] == before["text_encoder"]
    diff = (out.images[0] - plain["plain"]).abs().max().item()
    print(f"int8 transformer {after['transformer']} of {full} bytes, max |diff| {diff:.2e}")
    assert 0 < diff < 0.05
