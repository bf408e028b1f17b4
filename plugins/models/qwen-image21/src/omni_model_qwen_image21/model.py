"""What the step-wise contract needs of diffusers' ``QwenImage21Transformer2DModel``, and nothing more.

diffusers' transformer takes ONE layout per call (``img_mask[0]``, ``img_shapes[0]``: "samples share a layout")
and keeps the text prefix's keys/values in one ``QwenImage21KVCache`` object per pipeline call. Omni batches
requests of different prompt lengths (a text of ``L`` tokens puts the target image's rotary frame index at
``L``) and admits requests into a running wave at any step, so both must be per request:

* :func:`prefix_kv` is diffusers' ``kv_cache_mode="extract"`` for one text alone: the prefix (text) tokens run
  through every block, causal, modulated from ``t = 0`` (``causal_condition``), and each block's post-RoPE keys
  and values are kept, flattened to ``[1, L, layers * 2 * heads * head_dim]``. Under ``causal_condition`` the
  prefix never attends to the image, so this is exactly what the first denoising step of diffusers stores. The
  pipeline computes it once per request and branch in ``prepare_encode`` and keeps it on the request's state.
* :class:`OmniQwenImage21Transformer` adds only a ``forward`` that is diffusers' ``kv_cache_mode="cached"``
  step for a batch whose rows each bring their own prefix (zero-padded to the longest, a key-padding mask) and
  their own rotary table; the blocks, projections, norms and modulation are diffusers' own modules, called
  in diffusers' plain block loop. The transformer is given this class after loading (``__class__``, no new
  parameters: the weights, their names and the folder stay diffusers').
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel
from diffusers.utils.peft_utils import apply_lora_scale


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen(use_real=False)`` on ``[B, S, H, D]`` with a complex table ``[S, D/2]``
    (one for every row) or ``[B, S, D/2]`` (each row its own)."""
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs.unsqueeze(1) if freqs.dim() == 2 else freqs.unsqueeze(2)
    return torch.view_as_real(x_c * freqs).flatten(3).type_as(x)


def head_dim_of(transformer: torch.nn.Module) -> int:
    attn = transformer.transformer_blocks[0].attn
    return attn.inner_dim // attn.heads


def qkv(attn: Any, hidden_states: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
    """diffusers' ``_qwenimage21_prepare_qkv`` without its cache: projections, QK RMS norms, RoPE. Split by
    ``head_dim`` (under tensor parallelism a rank holds some of the heads)."""
    q = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
    k = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
    v = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
    q = attn.norm_q(q).to(v.dtype)
    k = attn.norm_k(k).to(v.dtype)
    return rotate(q, freqs), rotate(k, freqs), v


def text_rotary(transformer: torch.nn.Module, length: int, device: Any) -> torch.Tensor:
    """The rotary table ``[L, D/2]`` of a text-only prefix of ``length`` tokens (diffusers' ``QwenImage21Rope``:
    text advances one position on all three axes)."""
    return transformer.pos_embed([], torch.zeros(length, dtype=torch.bool, device=device), device=device)


def target_rotary(transformer: torch.nn.Module, text_len: int, grid: tuple[int, int], device: Any) -> torch.Tensor:
    """The rotary table ``[h * w, D/2]`` of the target image after a text of ``text_len`` tokens, as diffusers'
    ``QwenImage21Rope`` lays out ``[text, target]`` (the frame axis frozen at ``text_len``, h/w centred)."""
    h, w = grid
    mask = torch.cat([torch.zeros(text_len, dtype=torch.bool), torch.ones(h * w, dtype=torch.bool)]).to(device)
    return transformer.pos_embed([(1, h, w)], mask, device=device)[text_len:]


#: the name diffusers' ``apply_group_offloading`` registers its hook under (``diffusers.hooks.group_offloading``)
GROUP_OFFLOADING_HOOK = "group_offloading"


@contextlib.contextmanager
def weights_in(module: torch.nn.Module) -> Iterator[None]:
    """The offload hooks ``module``'s own ``forward`` would run, around code that uses its submodules directly
    (:func:`prefix_kv` calls the blocks' projections and norms, never ``forward``, so offload hooks on ``forward``
    would otherwise leave the weights on the host):

    * ``offload="model"`` (Omni's :class:`~omni_core.optimize.model_offload.ModelOffload`, accelerate's
      ``CpuOffload``): the module's ``_hf_hook.pre_forward``, the protocol diffusers' ``apply_forward_hook`` follows
      for ``vae.encode`` / ``vae.decode``: the whole component comes in (and evicts the one before it);
    * ``offload="group"`` (diffusers' ``apply_group_offloading``): the module's group-offloading hook onloads its
      group before and offloads it after, as its ``forward`` does (the top-level module's group: the parameters
      outside the blocks; each block's group: that block).

    Without any offload hook this does nothing."""
    hf = getattr(module, "_hf_hook", None)
    if hf is not None and hasattr(hf, "pre_forward"):
        hf.pre_forward(module)
    registry = getattr(module, "_diffusers_hook", None)
    group = registry.get_hook(GROUP_OFFLOADING_HOOK) if registry is not None else None
    if group is not None:
        group.pre_forward(module)
    try:
        yield
    finally:
        if group is not None:
            group.post_forward(module, None)
        if hf is not None and hasattr(hf, "post_forward"):
            hf.post_forward(module, None)


@torch.no_grad()
def prefix_kv(transformer: torch.nn.Module, text: torch.Tensor) -> torch.Tensor:
    """The text prefix's keys and values of every block, ``[1, L, layers * 2 * heads * head_dim]``, for text
    embeddings ``[1, L, context_in_dim]`` (diffusers' extract step for one unpadded prompt; see the module
    docstring). The last block's attention output and MLP are not needed and not computed. Offload hooks are
    honoured (:func:`weights_in`: the transformer's own weights around the whole computation, each block's around
    its part), so ``offload="model"`` / ``"group"`` bring the weights in as for a denoising step."""
    with weights_in(transformer):
        return _prefix_kv(transformer, text)


def _prefix_kv(transformer: torch.nn.Module, text: torch.Tensor) -> torch.Tensor:
    t = transformer
    head_dim = head_dim_of(t)
    x = t.txt_in(text)
    # the t = 0 row diffusers appends under causal_condition, computed next to a zero "sampled" row as there
    temb = t.time_text_embed(x.new_zeros(2), x)
    mod1, mod2 = t.modulation(temb)[-1:].chunk(2, dim=-1)
    freqs = text_rotary(t, x.shape[1], x.device)
    causal = torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device))[None, None]
    kv = []
    blocks = t.transformer_blocks
    for i, block in enumerate(blocks):
        with weights_in(block):
            h, gate1 = block._modulate(block.img_norm1(x), mod1, None)
            q, k, v = qkv(block.attn, h, freqs, head_dim)
            kv.append(torch.stack([k, v], dim=2))  # [1, L, 2, H, D]
            if i == len(blocks) - 1:
                break
            out = dispatch_attention_fn(q, k, v, attn_mask=causal, dropout_p=0.0, backend=None)
            out = block.attn.to_out[1](block.attn.to_out[0](out.flatten(2, 3).type_as(q)))
            x = x + gate1.tanh() * out
            h2, gate2 = block._modulate(block.img_norm2(x), mod2, None)
            x = x + gate2.tanh() * block.img_mlp(h2)
            if x.dtype == torch.float16:
                x = x.clip(-65504, 65504)
    return torch.stack(kv, dim=2).flatten(2)  # [1, L, layers, 2, H, D] -> [1, L, layers * 2 * H * D]


class OmniQwenImage21Transformer(QwenImage21Transformer2DModel):
    """diffusers' transformer with a per-row cached-prefix ``forward`` (see the module docstring)."""

    @apply_lora_scale("attention_kwargs")
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, image_rotary_emb: torch.Tensor,
                prefix_kv: torch.Tensor, prefix_mask: torch.Tensor | None = None,
                attention_kwargs: dict[str, Any] | None = None,
                return_dict: bool = True) -> torch.Tensor | Transformer2DModelOutput:
        """One denoising step of the target image tokens.

        ``hidden_states [B, S, C]``: the packed target latents; ``timestep [B]`` in [0, 1]; ``image_rotary_emb
        [B, S, D/2]`` (complex): each row's table (its frame index follows its own text); ``prefix_kv [B, P,
        layers * 2 * H * D]``: each row's :func:`prefix_kv`, zero-padded to the longest; ``prefix_mask [B, P]``
        (True = a real prefix token; None: nothing padded). Every block receives ``prefix_kv`` and the key mask
        unchanged; block ``i``'s attention processor reads its own layer of it.
        """
        x = self.img_in(hidden_states)
        timestep = timestep.to(x.dtype)
        # diffusers' extra t = 0 row (causal_condition; only the prefix reads it): computed alongside and dropped
        temb = self.time_text_embed(torch.cat([timestep, timestep.new_zeros(1)]), x)
        modulation = self.modulation(temb)[:-1]
        temb = temb[:-1]
        key_valid = None
        if prefix_mask is not None:  # [B, P + this rank's image tokens]: the prefix padding masked, the image whole
            key_valid = torch.cat([prefix_mask.bool(), prefix_mask.new_ones(x.shape[:2], dtype=torch.bool)], dim=1)
        for block in self.transformer_blocks:
            x = block(x, modulation, image_rotary_emb, None, None, prefix_kv, "cached", None, None, key_valid)
        x = self.norm_out(x, temb, None)
        output = self.proj_out(x)
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)


def install_step_forward(transformer: torch.nn.Module) -> torch.nn.Module:
    """Give a loaded ``QwenImage21Transformer2DModel`` the per-row cached-prefix forward (same module, same weights)."""
    if not isinstance(transformer, QwenImage21Transformer2DModel):
        raise TypeError(f"expected a QwenImage21Transformer2DModel, got {type(transformer).__name__}")
    if not transformer.config.causal_condition:
        raise ValueError("QwenImage21Pipeline (Omni) needs a causal_condition transformer: the text prefix is computed "
                         "once per request, which only holds when it is modulated from t = 0")
    transformer.__class__ = OmniQwenImage21Transformer
    return transformer


__all__ = ["OmniQwenImage21Transformer", "install_step_forward", "prefix_kv", "weights_in", "target_rotary", "text_rotary",
           "rotate"]
