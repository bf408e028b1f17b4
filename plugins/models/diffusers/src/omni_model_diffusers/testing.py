"""Tiny random-weight diffusers folders of several pipeline families, built offline, for the generic plugin's tests.

Each :class:`Family` knows how to build a diffusers-format folder (``save_pretrained``, safetensors, tokenizers
included) whose components are a few layers of width 16-32, and which small call arguments make one call fast on
CPU. Nothing is downloaded: tokenizers are built in code (see ``design/cpu-notes.md``) and configs follow the
``get_dummy_components`` of diffusers' own pipeline tests. This module imports only the standard library at
import time and needs torch, diffusers, transformers, tokenizers, numpy and pillow when a folder is built; it
must not import other Omni plugins (this plugin is installed alone).

``python -m omni_model_diffusers.testing [root]`` builds, reloads and runs every family (see :func:`smoke`).
"""

from __future__ import annotations

import os
import shutil
import string
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Family", "FAMILIES", "build_family", "example_image", "smoke",
           "clip_tokenizer", "t5_tokenizer", "gemma_tokenizer"]


# --------------------------------------------------------------------------------------------------- tokenizers
def clip_tokenizer():
    """Byte-level BPE over the 256 byte symbols (with and without ``</w>``), no merges (len 514).
    ``model_max_length`` must be set: the default (~1e30) overflows when pipelines pad to it."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    a = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(a)} | {c + "</w>": len(a) + i for i, c in enumerate(a)}
    for t in ["<|startoftext|>", "<|endoftext|>"]:
        vocab[t] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    """Unigram over single characters (len 98); serves T5 and UMT5 encoders."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def gemma_tokenizer():
    """Gemma's BPE (byte fallback) over single characters, no merges (len ~101); Sana pads to a fixed length."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581"])}
    for c in string.ascii_letters + string.digits + string.punctuation:
        vocab[c] = len(vocab)
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=512)


# --------------------------------------------------------------------------------------------- shared pieces
def _seeded(factory: Callable, *args, **kwargs):
    """Build one component after ``torch.manual_seed(0)``, as diffusers' tests do: same folder on every build."""
    import torch

    torch.manual_seed(0)
    return factory(*args, **kwargs)


def _clip_text(with_projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok = clip_tokenizer()
    cfg = CLIPTextConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4,
                         num_hidden_layers=2, vocab_size=len(tok), hidden_act="gelu", projection_dim=32)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return _seeded(cls, cfg).eval(), tok


def _t5_text(umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    cfg = config_cls(vocab_size=128, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, is_encoder_decoder=False)
    return _seeded(model_cls, cfg).eval(), t5_tokenizer()


def _one_level_vae(latent_channels: int):
    """A one-level AutoencoderKL (scale factor 1): a few kB, so the latent is the image size."""
    from diffusers import AutoencoderKL

    return _seeded(AutoencoderKL, sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
                   layers_per_block=1, latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False,
                   use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)


def _save(pipeline_class: str, components: dict, path) -> str:
    import diffusers

    path = os.fspath(path)
    getattr(diffusers, pipeline_class)(**components).save_pretrained(path, safe_serialization=True)
    return path


# -------------------------------------------------------------------------------------------------- families
def _sd_components(channels: tuple[int, int] = (4, 8)) -> dict:
    """diffusers' SD test components (2-level UNet of 4/8 channels, x2 VAE), with the offline CLIP tokenizer;
    ``channels``: a wider UNet (the benchmark's, so a call costs more than the engine around it)."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

    unet = _seeded(UNet2DConditionModel, block_out_channels=channels, layers_per_block=1, sample_size=16,
                   in_channels=4, out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=2)
    vae = _seeded(AutoencoderKL, block_out_channels=[4, 8], in_channels=3, out_channels=3,
                  down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                  latent_channels=4, norm_num_groups=2, sample_size=32)
    text_encoder, tokenizer = _clip_text()
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler,
            "safety_checker": None, "feature_extractor": None, "image_encoder": None,
            "requires_safety_checker": False}


def build_sd(path, channels: tuple[int, int] = (4, 8)) -> str:
    return _save("StableDiffusionPipeline", _sd_components(channels), path)


def build_sd_img2img(path) -> str:
    return _save("StableDiffusionImg2ImgPipeline", _sd_components(), path)


def build_sd3(path) -> str:
    """diffusers' SD3 test: 1 joint block, two projected CLIPs (pooled 2x32) and a T5 of width 32."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    transformer = _seeded(SD3Transformer2DModel, sample_size=32, patch_size=1, in_channels=4, num_layers=1,
                          attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                          joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)
    te, tok = _clip_text(with_projection=True)
    te2, tok2 = _clip_text(with_projection=True)
    te3, tok3 = _t5_text()
    return _save("StableDiffusion3Pipeline", {
        "transformer": transformer, "vae": _one_level_vae(4), "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": te, "tokenizer": tok, "text_encoder_2": te2, "tokenizer_2": tok2,
        "text_encoder_3": te3, "tokenizer_3": tok3, "image_encoder": None, "feature_extractor": None}, path)


def build_pixart_sigma(path) -> str:
    """diffusers' PixArt test transformer (2 blocks, adaLN-single) on a T5 of width 32, a DPM-Solver++ (epsilon)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel

    transformer = _seeded(PixArtTransformer2DModel, sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8,
                          num_attention_heads=3, caption_channels=32, in_channels=4, cross_attention_dim=24,
                          out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
                          num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False,
                          norm_eps=1e-6)
    te, tok = _t5_text()
    return _save("PixArtSigmaPipeline", {"transformer": transformer, "vae": _one_level_vae(4), "text_encoder": te,
                                         "tokenizer": tok, "scheduler": DPMSolverMultistepScheduler()}, path)


def _flux_components() -> dict:
    """diffusers' FLUX test: one double and one single block, guidance-distilled (FLUX.1-dev layout)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    transformer = _seeded(FluxTransformer2DModel, patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                          pooled_projection_dim=32, axes_dims_rope=[4, 4, 8], guidance_embeds=True)
    te, tok = _clip_text()
    te2, tok2 = _t5_text()
    return {"transformer": transformer, "vae": _one_level_vae(1), "text_encoder": te, "tokenizer": tok,
            "text_encoder_2": te2, "tokenizer_2": tok2, "scheduler": FlowMatchEulerDiscreteScheduler(),
            "image_encoder": None, "feature_extractor": None}


def build_flux(path) -> str:
    return _save("FluxPipeline", _flux_components(), path)


def build_flux_kontext(path) -> str:
    return _save("FluxKontextPipeline", _flux_components(), path)


def build_wan(path) -> str:
    """Wan 2.1 T2V as in diffusers' test (2 blocks, 3-channel-base VAE), UMT5 text encoder and the UniPC
    flow-prediction scheduler released Wan folders ship."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    transformer = _seeded(WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                          in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                          cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    vae = _seeded(AutoencoderKLWan, base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                  temperal_downsample=[False, True, True])
    te, tok = _t5_text(umt5=True)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    return _save("WanPipeline", {"transformer": transformer, "vae": vae, "text_encoder": te, "tokenizer": tok,
                                 "scheduler": scheduler, "transformer_2": None}, path)


def _clip_image_processor(**kwargs):
    """``CLIPImageProcessor`` where torchvision is installed, else transformers 5's PIL twin (same preprocessing)."""
    import transformers

    try:
        import torchvision  # noqa: F401
    except ImportError:
        return transformers.CLIPImageProcessorPil(**kwargs)
    return transformers.CLIPImageProcessor(**kwargs)


def build_wan_i2v(path) -> str:
    """Wan 2.1 I2V layout: a 36-channel transformer (noise + mask + condition latents) with image cross-attention
    (``image_dim``, ``added_kv_proj_dim``) fed by a 4-wide CLIP vision tower (penultimate hidden states, as
    released) with 8x8 patches (17 image tokens).
    ``model_index.json`` names ``CLIPImageProcessor`` as released folders do even where the PIL twin was saved
    (no torchvision); transformers loads the PIL one there."""
    import json

    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import CLIPVisionConfig, CLIPVisionModel

    transformer = _seeded(WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                          in_channels=36, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                          cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=4,
                          added_kv_proj_dim=24)
    vae = _seeded(AutoencoderKLWan, base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                  temperal_downsample=[False, True, True])
    image_encoder = _seeded(CLIPVisionModel, CLIPVisionConfig(
        hidden_size=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8)).eval()
    te, tok = _t5_text(umt5=True)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    path = _save("WanImageToVideoPipeline", {
        "transformer": transformer, "vae": vae, "text_encoder": te, "tokenizer": tok, "scheduler": scheduler,
        "image_encoder": image_encoder, "image_processor": _clip_image_processor(crop_size=32, size=32),
        "transformer_2": None}, path)
    index_path = os.path.join(path, "model_index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    if index.get("image_processor", [None, None])[1] == "CLIPImageProcessorPil":
        index["image_processor"][1] = "CLIPImageProcessor"
        with open(index_path, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return path


def build_ltx(path) -> str:
    """diffusers' LTX-Video test: 1 block, a causal video VAE compressing 4x in space and time, T5."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    transformer = _seeded(LTXVideoTransformer3DModel, in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                          num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32, num_layers=1,
                          caption_channels=32)
    vae = _seeded(AutoencoderKLLTXVideo, in_channels=3, out_channels=3, latent_channels=8,
                  block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                  layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
                  spatio_temporal_scaling=(True, True, False, False),
                  decoder_spatio_temporal_scaling=(True, True, False, False),
                  decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
                  upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
                  encoder_causal=True, decoder_causal=False)
    te, tok = _t5_text()
    return _save("LTXPipeline", {"transformer": transformer, "vae": vae, "text_encoder": te, "tokenizer": tok,
                                 "scheduler": FlowMatchEulerDiscreteScheduler()}, path)


def build_sana(path) -> str:
    """diffusers' Sana test (linear-attention DiT, deep-compression VAE x2) with a Gemma-2 encoder of width 16
    and Sana's released scheduler (DPM-Solver++ on flow sigmas)."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    transformer = _seeded(SanaTransformer2DModel, patch_size=1, in_channels=4, out_channels=4, num_layers=1,
                          num_attention_heads=2, attention_head_dim=4, num_cross_attention_heads=2,
                          cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=16, sample_size=32)
    vae = _seeded(AutoencoderDC, in_channels=3, latent_channels=4, attention_head_dim=2,
                  encoder_block_types=("ResBlock", "EfficientViTBlock"),
                  decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
                  decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)),
                  decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1],
                  downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
                  decoder_act_fns="silu", scaling_factor=0.41407)
    tok = gemma_tokenizer()
    te = _seeded(Gemma2Model, Gemma2Config(head_dim=8, hidden_size=16, intermediate_size=32,
                                           max_position_embeddings=512, num_attention_heads=2, num_hidden_layers=1,
                                           num_key_value_heads=2, vocab_size=128, pad_token_id=tok.pad_token_id,
                                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return _save("SanaPipeline", {"transformer": transformer, "vae": vae, "text_encoder": te, "tokenizer": tok,
                                  "scheduler": scheduler}, path)


@dataclass(frozen=True)
class Family:
    """One pipeline family: how to build its tiny folder and which call arguments keep one call fast."""

    name: str
    pipeline_class: str  # as in model_index.json's "_class_name"
    build: Callable[[str], str]  # (path) -> path
    call_kwargs: dict = field(default_factory=dict)
    image_input: bool = False  # the call takes an input ``image`` (see example_image)
    video: bool = False  # output is frames (B, F, C, H, W) with output_type="pt"
    scheduler_kind: str = "flow"  # "flow" (flow matching) or "ddpm-style" (noise-prediction schedulers)


_FAMILIES = [
    Family("sd", "StableDiffusionPipeline", build_sd,
           {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 5.0}, scheduler_kind="ddpm-style"),
    # strength 0.7 of 3 steps runs 2; the output takes the input image's size (no height/width argument)
    Family("sd-img2img", "StableDiffusionImg2ImgPipeline", build_sd_img2img,
           {"num_inference_steps": 3, "strength": 0.7, "guidance_scale": 5.0}, image_input=True,
           scheduler_kind="ddpm-style"),
    Family("sd3", "StableDiffusion3Pipeline", build_sd3,
           {"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 5.0, "max_sequence_length": 16}),
    # resolution binning would resize to PixArt's 2048-px aspect buckets; clean_caption needs bs4 + ftfy
    Family("pixart-sigma", "PixArtSigmaPipeline", build_pixart_sigma,
           {"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 5.0, "max_sequence_length": 16,
            "use_resolution_binning": False, "clean_caption": False}, scheduler_kind="ddpm-style"),
    Family("flux", "FluxPipeline", build_flux,
           {"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 3.5, "max_sequence_length": 16}),
    # _auto_resize=False: else the input is resized to a ~1 MP Kontext bucket
    Family("flux-kontext", "FluxKontextPipeline", build_flux_kontext,
           {"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 2.5, "max_sequence_length": 16,
            "max_area": 16 * 16, "_auto_resize": False}, image_input=True),
    Family("wan", "WanPipeline", build_wan,
           {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 5.0,
            "max_sequence_length": 16}, video=True),
    # diffusers 0.42 cleans Wan I2V prompts with ftfy without checking it is installed (NameError without it)
    Family("wan-i2v", "WanImageToVideoPipeline", build_wan_i2v,
           {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 5.0,
            "max_sequence_length": 16}, image_input=True, video=True),
    Family("ltx", "LTXPipeline", build_ltx,
           {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 3.0,
            "max_sequence_length": 16}, video=True),
    # complex_human_instruction=None: else ~300 tokens of instructions are prepended to every prompt
    Family("sana", "SanaPipeline", build_sana,
           {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 4.5, "max_sequence_length": 16,
            "use_resolution_binning": False, "complex_human_instruction": None}),
]

#: family name -> Family
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}


def build_family(name: str, root) -> str:
    """Build family ``name`` into ``root/name`` unless a ``model_index.json`` is already there; returns the path.
    Builds into a sibling temp folder and renames it, so a crashed or concurrent build never leaves half a folder."""
    path = os.path.join(os.fspath(root), name)
    if os.path.exists(os.path.join(path, "model_index.json")):
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    FAMILIES[name].build(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def example_image(height: int = 32, width: int = 32):
    """A deterministic RGB gradient with a bright square: some structure for image-input pipelines to encode."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                    (x + y) * 255 // max(width + height - 2, 1)], axis=-1).astype(np.uint8)
    rgb[height // 4:height // 2, width // 4:width // 2] = 255
    return Image.fromarray(rgb, "RGB")


def _folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def smoke(root=None, names=None) -> list[dict]:
    """Build each family, reload it (safetensors only) and call it: once (``call``, includes first-call warm-up),
    again with the same seed (``warm``; must be bit-identical) and with 2 prompts of different lengths and 2
    generators (``batch2``; batch 2 out). Prints and returns times, output shapes and folder sizes."""
    import tempfile

    import torch
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    root = root or tempfile.mkdtemp(prefix="omni-diffusers-tiny-")
    rows = []
    print(f"{'family':14} {'build s':>7} {'load s':>6} {'call s':>6} {'warm s':>6} {'batch2 s':>8} {'MB':>5}  "
          f"shape / batch-2 shape", flush=True)
    for name in names or FAMILIES:
        fam = FAMILIES[name]
        t0 = time.perf_counter()
        path = build_family(name, root)
        t1 = time.perf_counter()
        pipe = DiffusionPipeline.from_pretrained(path, use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        assert type(pipe).__name__ == fam.pipeline_class, type(pipe).__name__
        t2 = time.perf_counter()
        kwargs = dict(fam.call_kwargs, output_type="pt")
        if fam.image_input:
            kwargs["image"] = example_image(32, 32)
        outs, times = [], []
        for _ in range(2):
            t = time.perf_counter()
            outs.append(pipe(prompt="a tiny red fox", generator=torch.Generator().manual_seed(0), **kwargs)[0])
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        out2 = pipe(prompt=["fox", "a much longer prompt about a small fox in the snow"],
                    generator=[torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)], **kwargs)[0]
        t_batch = time.perf_counter() - t
        out = outs[0]
        assert torch.equal(outs[0], outs[1]), f"{name}: same seed, different output"
        assert out2.shape[0] == 2 and tuple(out2.shape[1:]) == tuple(out.shape[1:]), (out.shape, out2.shape)
        assert torch.isfinite(out).all() and torch.isfinite(out2).all()
        row = {"family": name, "build_s": t1 - t0, "load_s": t2 - t1, "call_s": times[0], "warm_s": times[1],
               "batch2_s": t_batch, "mb": _folder_mb(path), "shape": tuple(out.shape), "shape2": tuple(out2.shape)}
        rows.append(row)
        print(f"{name:14} {row['build_s']:7.2f} {row['load_s']:6.2f} {row['call_s']:6.3f} {row['warm_s']:6.3f} "
              f"{row['batch2_s']:8.3f} {row['mb']:5.1f}  {row['shape']} / {row['shape2']}", flush=True)
    return rows


if __name__ == "__main__":
    import sys

    smoke(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2:] or None)
