"""Tiny random-weight LTX-2 folders for tests and benchmarks (no download, tokenizer built offline).

``build_tiny_ltx2(path)`` writes a diffusers-format ``LTX2Pipeline`` folder, ``build_tiny_ltx2_i2v(path)`` an
``LTX2ImageToVideoPipeline`` one (the same components). Configs follow diffusers' own LTX-2 pipeline tests
(``tests/pipelines/ltx2/testing_utils.py``), with a Gemma-3 text encoder built from a tiny config instead of
``hf-internal-testing/tiny-gemma3`` (nothing is fetched) and the head counts chosen so Ulysses-2 divides every
attention of the transformer.
"""

from __future__ import annotations

import os
import string


def gemma_tokenizer():
    """Gemma's BPE (byte fallback) over single characters, no merges; nothing fetched. LTX-2 pads on the left."""
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581"])}
    for c in string.ascii_letters + string.digits + string.punctuation:
        vocab[c] = len(vocab)
    tok = GemmaTokenizer(vocab=vocab, merges=[], model_max_length=1024)
    tok.padding_side = "left"
    return tok


def tiny_gemma3(vocab_size: int = 128):
    """A two-layer Gemma-3 (``Gemma3ForConditionalGeneration``, as released LTX-2 folders name) of width 32 (the connectors' width) with
    a one-layer SigLIP tower it never uses (text only)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config={"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 8,
                     "max_position_embeddings": 1024, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
        vision_config={"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 8, "patch_size": 4},
        mm_tokens_per_image=4, boi_token_index=4, eoi_token_index=4, image_token_index=4)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_ltx2_components(num_layers: int = 2, num_heads: int = 2, registers: int | None = None) -> dict:
    """diffusers' test components (transformer, connectors, both VAEs, vocoder, scheduler) around the tiny
    Gemma-3, with two changes: the transformer's blocks take STG's perturbation (``perturbed_attn``, as LTX-2.3;
    without it diffusers' STG pass equals the conditional one) and the vocoder upsamples x160 (its mel hop), so
    the waveform lasts about num_frames / frame_rate seconds as a released folder's does (diffusers' test: x4). ``num_heads`` (video and audio attention heads, 2 as in diffusers' tests) must be divisible by a
    Ulysses degree; ``registers``: the connectors' learnable registers (None as in diffusers' tests: the text
    keeps its padding mask; a number: padding replaced by registers, the mask all ones)."""
    import torch
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    text_encoder = tiny_gemma3()
    width, depth = text_encoder.config.text_config.hidden_size, text_encoder.config.text_config.num_hidden_layers
    torch.manual_seed(0)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=num_heads,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=num_heads, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=num_layers, qk_norm="rms_norm_across_heads", caption_channels=width, rope_double_precision=False,
        rope_type="split", perturbed_attn=True)
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=width, text_proj_in_factor=depth + 1, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=registers, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=registers, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[20, 32], upsample_factors=[10, 16], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    return {"transformer": transformer, "vae": vae, "audio_vae": audio_vae, "scheduler": FlowMatchEulerDiscreteScheduler(),
            "text_encoder": text_encoder, "tokenizer": gemma_tokenizer(), "connectors": connectors, "vocoder": vocoder,
            "processor": None, "prompt_enhancer": None, "duration_head": None}


def _save(cls_name: str, components: dict, path: str | os.PathLike) -> str:
    import diffusers

    path = os.fspath(path)
    getattr(diffusers, cls_name)(**components).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_ltx2(path: str | os.PathLike, num_layers: int = 2, num_heads: int = 2,
                    registers: int | None = None) -> str:
    """Save a tiny random ``LTX2Pipeline`` folder (safetensors) into ``path``; returns the folder."""
    return _save("LTX2Pipeline", tiny_ltx2_components(num_layers, num_heads, registers), path)


def build_tiny_ltx2_i2v(path: str | os.PathLike, num_layers: int = 2, num_heads: int = 2) -> str:
    """Save a tiny random ``LTX2ImageToVideoPipeline`` folder (the same components); returns the folder."""
    components = tiny_ltx2_components(num_layers, num_heads)
    return _save("LTX2ImageToVideoPipeline", components, path)


def parallel_outputs(folder: str, configs: dict[str, dict], requests: list[dict], admit_at: list[int],
                     world_size: int = 2) -> dict[str, tuple[list, list, int]]:
    """Run ``requests`` (dicts: ``prompt``, optional ``negative_prompt``, ``seed`` and SamplingParams fields) under
    each parallel config of ``configs`` in ONE group of ``world_size`` gloo processes (forked: one start serves
    every config): per config the pipeline is loaded through the real loader with that config's parallel state
    and the requests run in step mode, admitted at ``admit_at``. Returns ``{config name: (rank 0's video
    tensors, its waveforms, bytes rank 0 sent)}``."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.start_processes(_parallel_worker, args=(world_size, port, folder, configs, requests, admit_at, out),
                           nprocs=world_size, start_method="fork", join=True)
        return torch.load(out)


def _parallel_worker(rank: int, world_size: int, port: int, folder: str, configs: dict, requests: list,
                     admit_at: list, out: str) -> None:
    import torch
    import torch.distributed as dist

    from omni_core.config import OmniDiffusionConfig
    from omni_core.distributed import (communication_stats, destroy_parallel_state, init_parallel_state,
                                       reset_communication_stats)
    from omni_core.pipelines import load_pipeline, resolve_model
    from omni_core.testing import make_state, run_step_batch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results = {}
    try:
        for name, pc in configs.items():
            init_parallel_state(pc, rank, world_size)
            try:
                config = OmniDiffusionConfig(model=folder, dtype="float32", parallel_config=pc)
                pipeline = load_pipeline(resolve_model(folder), config, "cpu", torch.float32)
                reset_communication_stats()
                states = []
                for spec in requests:
                    spec = dict(spec)
                    prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
                    states.append(make_state(pipeline, prompt, negative_prompt=negative, model_path=folder, **spec))
                with torch.inference_mode():
                    outs = run_step_batch(pipeline, states, admit_at=admit_at)
                results[name] = ([o.tensor for o in outs], [o.audio for o in outs],
                                 communication_stats()["total"])
            finally:
                destroy_parallel_state()
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
