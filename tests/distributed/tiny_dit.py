"""Tiny transformers that opt into sequence parallelism through a plan (used by the tests and bench/parallel.py).

* ``TinyDiT`` patchifies inside its forward (latents ``[B, C, H, W]`` in, same shape out): the plan shards the
  output of ``x_embedder`` and of the rotary table module ``pos_embed``, and gathers before ``final_layer``.
  Blocks: joint text+image attention (text in front, key-padding mask on text), self-attention with rotary
  embeddings, cross-attention to the text.
* ``TinyWanLike`` builds its tokens inline (conv, flatten, transpose): the plan shards the first block's input
  and gathers the output of ``proj_out``.
* ``TinyTokenModel`` takes tokens ``[B, S, C]`` and per-token rotary tables as forward arguments; the plan
  shards them and gathers the (tuple) output.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_core.attention import Attention


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[S, head_dim]`` for float positions ``[S]``."""
    freqs = 1.0 / (100.0 ** (torch.arange(0, head_dim // 2, dtype=torch.float32) / (head_dim // 2)))
    angles = positions.float()[:, None] * freqs[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[None, :, None] + torch.cat([-x2, x1], dim=-1) * sin[None, :, None]


class PosEmbed(nn.Module):
    """Rotary tables for an ``h x w`` grid (a per-token output the plan must shard)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return rope_tables((ys * 0.37 + xs * 1.3).flatten(), self.head_dim)


class SelfBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads or heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.kv_heads * self.hd)
        self.attn = Attention(heads, self.hd, num_kv_heads=self.kv_heads, role="self")
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        x = self.norm(h)
        q = self.q(x).view(b, s, self.heads, self.hd)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        o = self.attn(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        h = h + self.out(o.reshape(b, s, -1))
        return h + self.mlp(h)


class CrossBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.attn = Attention(heads, self.hd, role="cross")
        self.out = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, txt: torch.Tensor, txt_mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = h.shape
        q = self.q(self.norm(h)).view(b, s, self.heads, self.hd)
        k, v = self.kv(txt).view(b, txt.shape[1], 2, self.heads, self.hd).unbind(2)
        return h + self.out(self.attn(q, k, v, txt_mask).reshape(b, s, -1))


class JointBlock(nn.Module):
    """MMDiT-style: text and image tokens attend jointly (text first), each stream with its own weights."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.img_norm, self.txt_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.img_qkv, self.txt_qkv = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.img_out, self.txt_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attn = Attention(heads, self.hd, role="joint")

    def forward(self, h, txt, txt_mask, cos, sin):
        b, s, _ = h.shape
        t = txt.shape[1]
        iq, ik, iv = self.img_qkv(self.img_norm(h)).view(b, s, 3, self.heads, self.hd).unbind(2)
        tq, tk, tv = self.txt_qkv(self.txt_norm(txt)).view(b, t, 3, self.heads, self.hd).unbind(2)
        iq, ik = apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)
        mask = None
        if txt_mask is not None:
            mask = torch.cat([txt_mask, torch.ones(b, s, dtype=torch.bool, device=h.device)], dim=1)
        o = self.attn(torch.cat([tq, iq], 1), torch.cat([tk, ik], 1), torch.cat([tv, iv], 1), mask)
        to, io = o[:, :t].reshape(b, t, -1), o[:, t:].reshape(b, s, -1)
        return h + self.img_out(io), txt + self.txt_out(to)


class TinyDiT(nn.Module):
    """Latents in, latents out; patchify/unpatchify happen inside forward."""

    _sp_plan = {
        "shard_after": {"x_embedder": 1, "pos_embed": {0: 0, 1: 0}},
        "gather_before": "final_layer",
        "gather": None,
        "joint_text": "encoder_hidden_states",
        "replicate": ("encoder_hidden_states", "encoder_mask", "timestep"),
    }

    def __init__(self, in_channels: int = 4, patch: int = 2, dim: int = 64, heads: int = 4, text_dim: int = 32,
                 depth: int = 1, kv_heads: int | None = None) -> None:
        super().__init__()
        self.c, self.p = in_channels, patch
        self.x_embedder = nn.Linear(in_channels * patch * patch, dim)
        self.txt_in = nn.Linear(text_dim, dim)
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.pos_embed = PosEmbed(dim // heads)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.extend([JointBlock(dim, heads), SelfBlock(dim, heads, kv_heads), CrossBlock(dim, heads)])
        self.final_layer = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, in_channels * patch * patch))

    def forward(self, x: torch.Tensor, encoder_hidden_states: torch.Tensor, encoder_mask: torch.Tensor | None = None,
                timestep: torch.Tensor | None = None) -> torch.Tensor:
        b, c, hh, ww = x.shape
        p = self.p
        gh, gw = hh // p, ww // p
        tokens = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        h = self.x_embedder(tokens)
        cos, sin = self.pos_embed(gh, gw)
        txt = self.txt_in(encoder_hidden_states)
        if timestep is not None:
            h = h + self.t_embed(timestep.float().view(-1, 1))[:, None]
        for block in self.blocks:
            if isinstance(block, JointBlock):
                h, txt = block(h, txt, encoder_mask, cos, sin)
            elif isinstance(block, SelfBlock):
                h = block(h, cos, sin)
            else:
                h = block(h, txt, encoder_mask)
        out = self.final_layer(h)
        return out.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hh, ww)


class TinyTokenModel(nn.Module):
    """Tokens in, ``(tokens,)`` out; rotary tables come in as forward arguments."""

    _sp_plan = {"shard": {"hidden_states": 1, "rotary_cos": 0, "rotary_sin": 0}, "gather": 1,
                "joint_text": "encoder_hidden_states"}

    def __init__(self, in_dim: int = 8, dim: int = 64, heads: int = 8, text_dim: int = 32) -> None:
        super().__init__()
        self.proj_in = nn.Linear(in_dim, dim)
        self.txt_in = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList([JointBlock(dim, heads), SelfBlock(dim, heads, heads // 2), CrossBlock(dim, heads)])
        self.proj_out = nn.Linear(dim, in_dim)

    def forward(self, hidden_states, encoder_hidden_states, rotary_cos, rotary_sin, encoder_mask=None):
        h, txt = self.proj_in(hidden_states), self.txt_in(encoder_hidden_states)
        h, txt = self.blocks[0](h, txt, encoder_mask, rotary_cos, rotary_sin)
        h = self.blocks[1](h, rotary_cos, rotary_sin)
        h = self.blocks[2](h, txt, encoder_mask)
        return (self.proj_out(h),)


class WanLikeBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.self_attn, self.cross_attn = SelfBlock(dim, heads), CrossBlock(dim, heads)

    def forward(self, hidden_states, encoder_hidden_states, rotary_emb):
        return self.cross_attn(self.self_attn(hidden_states, *rotary_emb), encoder_hidden_states, None)


class TinyWanLike(nn.Module):
    """Builds its tokens inline (conv patch embedding, flatten, transpose), as diffusers' Wan does: the plan
    shards the first block's input and gathers the output of ``proj_out``."""

    _sp_plan = {"shard_before": {"blocks.0": {"hidden_states": 1}}, "shard_after": {"rope": {0: 0, 1: 0}},
                "gather_after": "proj_out", "gather": None}

    def __init__(self, in_channels: int = 4, patch: int = 2, dim: int = 64, heads: int = 4, text_dim: int = 32,
                 depth: int = 2) -> None:
        super().__init__()
        self.c, self.p = in_channels, patch
        self.patch_embedding = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.rope = PosEmbed(dim // heads)
        self.text_embedding = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList([WanLikeBlock(dim, heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels * patch * patch)

    def forward(self, hidden_states, encoder_hidden_states):
        b, c, hh, ww = hidden_states.shape
        p = self.p
        rotary = self.rope(hh // p, ww // p)
        h = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
        txt = self.text_embedding(encoder_hidden_states)
        for block in self.blocks:
            h = block(h, txt, rotary)
        out = self.proj_out(self.norm_out(h))
        return out.reshape(b, hh // p, ww // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hh, ww)


def build(cls: type, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs).eval()


def text_inputs(batch: int, text_len: int, text_dim: int = 32, seed: int = 1):
    """Text embeddings and a key-padding mask that differs per sample (sample 0 has 2 padding tokens)."""
    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(batch, text_len, text_dim, generator=g)
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    mask[0, text_len - 2:] = False
    return txt, mask
