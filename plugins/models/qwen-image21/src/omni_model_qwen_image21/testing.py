"""Tiny random-weight Qwen-Image 2.1 folders for tests and benchmarks (no download, tokenizer built offline).

``build_tiny_qwen_image21(path)`` writes a diffusers-format folder that both Omni's ``QwenImage21Pipeline`` and
diffusers' own ``QwenImage21Pipeline.from_pretrained`` load (diffusers gets the processor handed in where
torchvision is missing: :func:`diffusers_reference_kwargs`).
"""

from __future__ import annotations

import os

__all__ = ["qwen3vl_tokenizer", "tiny_qwen3vl_processor", "tiny_qwen_image21_components", "build_tiny_qwen_image21",
           "diffusers_reference_kwargs"]

#: the ChatML specials, then the Qwen-VL vision specials the 2.1 templates and the processor use
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>")

#: the chat template the pipeline's ``apply_chat_template`` of the system message needs (content given as parts)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3vl_tokenizer():
    """Byte-level BPE over the 256 byte symbols plus the ChatML and vision specials (ids 256..262); no merges, so
    one token per byte of the prompt."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for t in SPECIALS:
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen3vl_processor():
    """A ``Qwen3VLProcessor`` built offline (the PIL Qwen2-VL image processor, :func:`qwen3vl_tokenizer`); without
    torchvision it is the plugin's stand-in subclass (no video processor)."""
    from omni_model_qwen_image21.processor import image_processor_class, processor_class

    image_processor = image_processor_class()(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=64 * 64,
                                              size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    return processor_class()(image_processor=image_processor, tokenizer=qwen3vl_tokenizer(),
                             chat_template=CHAT_TEMPLATE)


def tiny_qwen_image21_components(num_layers: int = 2, num_heads: int = 4, sharpen: float = 4.0) -> dict:
    """Qwen-Image 2.1 components at test size: a 2-block single-stream transformer of ``num_heads`` heads of 16
    (4 serves Ulysses/TP degrees 2 and 4), a 2-layer Qwen3-VL text encoder of width 16, a x16 VAE of 4 latent
    channels (4 downsampling levels, no res-blocks: 32x32 pixels are 2x2 latents, 4 image tokens) and the
    processor. ``sharpen`` scales the attention's QK-norm weights so prompts and CFG move the image by many
    levels (with the plain init the image tokens attend almost uniformly over the ~30 template tokens)."""
    import torch
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=num_layers, attention_head_dim=16,
        num_attention_heads=num_heads, context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6))
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_q.weight.mul_(sharpen)
            block.attn.norm_k.weight.mul_(sharpen)
        # zero-init'ed in diffusers (stored as scale - 1): random so the text projection is not the identity
        transformer.txt_in.text_norm.weight.normal_(0, 0.5)
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
                                   temperal_downsample=[False, True, True, True], latents_mean=[0.0] * 4,
                                   latents_std=[1.0] * 4)
    tok = qwen3vl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    torch.manual_seed(0)
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 320,
                     "rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 16, "deepstack_visual_indexes": [0], "num_position_embeddings": 16},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "processor": tiny_qwen3vl_processor(),
            "scheduler": FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)}


def build_tiny_qwen_image21(path: str | os.PathLike, num_layers: int = 2, num_heads: int = 4,
                            sharpen: float = 4.0) -> str:
    """Save a tiny random Qwen-Image 2.1 pipeline (safetensors) into ``path``; returns the folder. The processor is
    recorded as transformers' ``Qwen3VLProcessor``, as in released folders, whichever class built it."""
    from diffusers import QwenImage21Pipeline

    from omni_model_qwen_image21.processor import record_as_qwen3vl_processor

    path = os.fspath(path)
    QwenImage21Pipeline(**tiny_qwen_image21_components(num_layers, num_heads, sharpen)).save_pretrained(
        path, safe_serialization=True)
    record_as_qwen3vl_processor(path)
    return path


def diffusers_reference_kwargs(folder: str) -> dict:
    """What diffusers' own ``DiffusionPipeline.from_pretrained`` needs for a folder here: the processor, handed in
    because transformers cannot load ``Qwen3VLProcessor`` without torchvision (``processor.py``)."""
    from omni_model_qwen_image21.processor import load_processor

    return {"processor": load_processor(folder)}


def parallel_outputs(folder: str, configs: dict[str, dict], requests: list[dict], admit_at: list[int],
                     world_size: int = 2) -> dict[str, tuple[list, int]]:
    """Run ``requests`` (dicts: ``prompt``, optional ``negative_prompt``, ``seed`` and SamplingParams fields) under
    each parallel config of ``configs`` in ONE group of ``world_size`` gloo processes: per config the pipeline is
    loaded through the real loader (its load plan installs the SP plan / splits the layers by the TP plan) with
    the parallel state of that config, and the requests run in step mode, admitted at ``admit_at``. One process
    start (the expensive part) serves every config. Returns ``{config name: (rank 0's output tensors, bytes rank
    0 sent)}``."""
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
                outs = run_step_batch(pipeline, states, admit_at=admit_at)
                results[name] = ([o.tensor for o in outs], communication_stats()["total"])
            finally:
                destroy_parallel_state()
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
