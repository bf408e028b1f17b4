"""The toy denoiser: a text-conditioned DiT over 2x2 pixel patches, and a bag-of-words text encoder.

Every attention is an :class:`omni_core.attention.Attention`, so attention backends and sequence
parallelism reach it. Small per-row vectors go through :func:`rowwise` so a row's result never depends on
how many rows share the call (CPU matrix kernels change code path for tiny batches).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from omni_core.attention import Attention


def rowwise(layer: nn.Module, v: torch.Tensor) -> torch.Tensor:
    """``layer(v)`` for ``[B, D]`` vectors, one row at a time (batch-invariant results)."""
    return torch.cat([layer(row) for row in v.split(1)])


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class ToyTextEncoder(ModelMixin, ConfigMixin):
    """Token ids ``[B, L]`` -> text states ``[B, L, dim]`` (an embedding and one MLP)."""

    @register_to_config
    def __init__(self, vocab_size: int = 512, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x + self.mlp(x)


class Heads(nn.Module):
    """Linear projections around an Omni ``Attention`` (self-attention when ``context`` is None)."""

    def __init__(self, dim: int, num_heads: int, role: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.ModuleList([nn.Linear(dim, dim) for _ in range(3)])
        self.attn = Attention(num_heads, self.head_dim, role=role)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        q, k, v = (proj(src).unflatten(-1, (self.num_heads, self.head_dim))
                   for proj, src in zip(self.qkv, (x, context, context)))
        return self.out(self.attn(q, k, v, attn_mask=mask).flatten(-2))


class ToyBlock(nn.Module):
    """adaLN self-attention over image tokens, cross-attention to the text, MLP."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = Heads(dim, num_heads, role="self")
        self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = Heads(dim, num_heads, role="cross")
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def modulated(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The timestep-modulated input of the self-attention (TeaCache's signal, see the spec)."""
        shift, scale = rowwise(self.ada, cond).chunk(6, dim=1)[:2]
        return modulate(self.norm1(x), shift, scale)

    def forward(self, x, cond, text, text_mask):
        shift1, scale1, gate1, shift2, scale2, gate2 = rowwise(self.ada, cond).chunk(6, dim=1)
        x = x + gate1[:, None] * self.self_attn(modulate(self.norm1(x), shift1, scale1))
        x = x + self.cross_attn(self.norm2(x), text, text_mask)
        return x + gate2[:, None] * self.mlp(modulate(self.norm3(x), shift2, scale2))


class Patchify(nn.Module):
    """Image ``[B, C, H, W]`` -> tokens ``[B, H/p * W/p, dim]``, with sin-cos row and column positions."""

    def __init__(self, channels: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images)
        dim, h, w = x.shape[1:]
        freq = torch.exp(-torch.arange(dim // 4, device=x.device) / (dim // 4) * 4.0)
        ys, xs = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
        pos = torch.cat([f(c.reshape(-1, 1) * freq) for c in (ys, xs) for f in (torch.sin, torch.cos)], dim=1)
        return x.flatten(2).transpose(1, 2) + pos.to(x.dtype)


class Head(nn.Module):
    """Final adaLN norm and projection of each token back to a patch of pixels."""

    def __init__(self, dim: int, patch: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.proj = nn.Linear(dim, patch * patch * channels)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = rowwise(self.ada, cond).chunk(2, dim=1)
        return self.proj(modulate(self.norm(x), shift, scale))


class ToyDiT(ModelMixin, ConfigMixin):
    """``forward(sample [B, C, H, W], timestep [B], text [B, L, text_dim], text_mask [B, L] bool)`` -> the
    flow-matching velocity ``[B, C, H, W]``: patchify -> ``blocks[i](x, cond, text, text_mask)`` -> head."""

    @register_to_config
    def __init__(self, channels: int = 3, patch: int = 2, dim: int = 64, depth: int = 4, num_heads: int = 4,
                 text_dim: int = 32) -> None:
        super().__init__()
        self.patchify = Patchify(channels, patch, dim)
        self.time_proj = Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(dim, dim)
        self.text_proj = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList([ToyBlock(dim, num_heads) for _ in range(depth)])
        self.head = Head(dim, patch, channels)

    def forward(self, sample, timestep, text, text_mask):
        b, c, h, w = sample.shape
        p = self.config.patch
        x = self.patchify(sample)
        cond = rowwise(self.time_embed, self.time_proj(timestep).to(x.dtype))
        text = self.text_proj(text)
        for block in self.blocks:
            x = block(x, cond, text, text_mask)
        out = self.head(x, cond)  # [B, tokens, p * p * c]
        return out.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
