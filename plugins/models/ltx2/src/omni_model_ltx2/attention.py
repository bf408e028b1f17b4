"""LTX-2's attention routed through Omni's ``Attention`` layer.

Why this exists: Omni's attention backends, per-role configs, sequence-parallel strategies and attention hooks
see only calls made through :class:`omni_core.attention.Attention`. The processor below computes exactly what
diffusers' ``LTX2PerturbedAttnProcessor`` computes (which is ``LTX2AudioVideoAttnProcessor`` plus the STG
perturbation: projections, the across-heads QK RMS norm, interleaved or split RoPE with separate query and key
tables, per-head gates, the output projection) and hands softmax(QK^T)V to an Omni layer. The roles of a
transformer block's six attentions:

========================  =================  ==========  =====================================
module                    role               category    keys
========================  =================  ==========  =====================================
``attn1``                 ``video_self``     self        video tokens
``audio_attn1``           ``audio_self``     self        audio tokens
``attn2``                 ``video_cross``    cross       text (video connector), masked
``audio_attn2``           ``audio_cross``    cross       text (audio connector), masked
``audio_to_video_attn``   ``audio_to_video`` cross       audio tokens (queries: video)
``video_to_audio_attn``   ``video_to_audio`` cross       video tokens (queries: audio)
========================  =================  ==========  =====================================

Under sequence parallelism the video tokens are sharded and the audio tokens stay whole on every rank (they are
few): the video self-attention runs Ulysses / Ring, the audio self-attention runs locally
(``skip_sequence_parallel``), the text and audio-to-video attentions are local cross-attentions (their keys are
whole), and the video-to-audio attention's whole audio queries reach every sharded video key
(``replicated_queries``).

The text attention mask arrives as diffusers' additive bias (``0`` = attend, ``-10000`` = padding, one row of
keys per batch row); the layer gets it as the boolean ``[rows, keys]`` key-padding mask every Omni backend takes
(the same result: ``exp(-10000)`` is 0 in float32). ``attention_config={"per_role": {"self": ...}}`` picks both
self-attentions by their category, ``{"video_self": ...}`` one of them.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

from omni_core.attention import Attention

#: module attribute name -> (role, role category)
ROLES = {"attn1": ("video_self", "self"), "audio_attn1": ("audio_self", "self"), "attn2": ("video_cross", "cross"),
         "audio_attn2": ("audio_cross", "cross"), "audio_to_video_attn": ("audio_to_video", "cross"),
         "video_to_audio_attn": ("video_to_audio", "cross")}


#: per-row 1/0 (keep / drop) of the audio-video cross-attentions in the current transformer call: the rows of
#: modality-isolation guidance run in the same call as the others with those attentions' outputs zeroed, which is
#: exactly diffusers' ``isolate_modalities=True`` for them (the block adds ``gate * 0``); None: all kept
_CROSS_MODAL_KEEP: contextvars.ContextVar = contextvars.ContextVar("omni_ltx2_cross_modal_keep", default=None)


@contextlib.contextmanager
def cross_modal_rows(keep: torch.Tensor | None):
    """Inside the block, the audio-video cross-attentions of rows where ``keep`` is 0 output zeros."""
    token = _CROSS_MODAL_KEEP.set(keep)
    try:
        yield
    finally:
        _CROSS_MODAL_KEEP.reset(token)


def _rope(attn, x: torch.Tensor, freqs) -> torch.Tensor:
    if attn.rope_type == "interleaved":
        return apply_interleaved_rotary_emb(x, freqs)
    if attn.rope_type == "split":
        return apply_split_rotary_emb(x, _local_heads(attn, freqs))
    return x


def _local_heads(attn, freqs: tuple) -> tuple:
    """Split RoPE's per-head tables ``[B, H, S, r]`` for the heads this rank holds: under tensor parallelism the
    projections give each rank ``attn.heads`` consecutive heads (the core divided the count), the tables all."""
    cos, sin = freqs
    if cos.dim() != 4 or cos.shape[1] == attn.heads:
        return freqs
    from omni_core.distributed.parallel_state import get_tp_group

    start = get_tp_group().rank_in_group * attn.heads
    return cos.narrow(1, start, attn.heads), sin.narrow(1, start, attn.heads)


def key_padding_mask(bias: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """diffusers' additive text bias ``[B, 1, L]`` (0 = attend) -> boolean ``[B, L]`` (True = attend); None when
    nothing is masked."""
    if bias is None:
        return None
    if bias.dim() != 3 or bias.shape[1] != 1:
        raise ValueError(f"LTX-2 attention: only a key-padding bias [batch, 1, keys] is supported, got "
                         f"{tuple(bias.shape)} (a per-query mask, e.g. IC-LoRA's video self-attention mask)")
    mask = bias[:, 0, :] == 0
    mask = mask.expand(batch, -1) if mask.shape[0] == 1 else mask
    return None if bool(mask.all()) else mask


class OmniLTX2AttnProcessor:
    """Drop-in for diffusers' LTX-2 attention processors whose attention kernel is an Omni layer."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: Attention, cross_modal: bool = False) -> None:
        self.layer = layer
        #: an audio-to-video / video-to-audio attention (zeroed for modality-isolation rows)
        self.cross_modal = cross_modal

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, query_rotary_emb=None, key_rotary_emb=None,
                 perturbation_mask: torch.Tensor | None = None, all_perturbed: bool | None = None) -> torch.Tensor:
        batch = hidden_states.shape[0]
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(encoder_hidden_states)
        if all_perturbed is None:
            all_perturbed = bool(torch.all(perturbation_mask == 0)) if perturbation_mask is not None else False
        if all_perturbed:  # STG: the block's self-attention replaced by its values
            hidden_states = value
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key = attn.norm_k(attn.to_k(encoder_hidden_states))
            if query_rotary_emb is not None:
                query = _rope(attn, query, query_rotary_emb)
                key = _rope(attn, key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            query = query.unflatten(2, (attn.heads, -1))
            key = key.unflatten(2, (attn.heads, -1))
            value = value.unflatten(2, (attn.heads, -1))
            mask = key_padding_mask(attention_mask, batch)
            hidden_states = self.layer(query, key, value, attn_mask=mask).flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                hidden_states = torch.lerp(value.flatten(2, 3), hidden_states, perturbation_mask)
        if gate_logits is not None:
            hidden_states = hidden_states.unflatten(2, (attn.heads, -1))
            hidden_states = (hidden_states * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        keep = _CROSS_MODAL_KEEP.get() if self.cross_modal else None
        if keep is not None:
            if keep.shape[0] != batch:
                raise ValueError(f"LTX-2 modality-isolation rows: {keep.shape[0]} rows marked, the call has {batch} "
                                 f"(a backend that runs only some rows of a call cannot take modality guidance)")
            hidden_states = hidden_states * keep.to(hidden_states.dtype)[:, None, None]
        return hidden_states


def install_omni_attention(transformer: torch.nn.Module, prefix: str = "") -> list[Attention]:
    """Give every attention of the transformer's blocks an Omni ``Attention`` layer (the module's ``omni_attn``
    child) and a processor that calls it. Call inside :func:`omni_core.forward_context.use_config`."""
    layers = []
    for i, block in enumerate(transformer.transformer_blocks):
        for attr, (role, category) in ROLES.items():
            module = getattr(block, attr)
            layer = Attention(module.heads, module.head_dim, role=role, role_category=category,
                              prefix=f"{prefix}transformer_blocks.{i}.{attr}",
                              skip_sequence_parallel=attr == "audio_attn1",
                              replicated_queries=attr == "video_to_audio_attn")
            module.add_module("omni_attn", layer)
            module.set_processor(OmniLTX2AttnProcessor(layer, cross_modal=attr.endswith("_to_video_attn")
                                                       or attr.endswith("_to_audio_attn")))
            layers.append(layer)
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no LTX-2 transformer blocks to route through Omni")
    return layers
