"""The shapes model: a small text encoder and a pixel-space diffusion transformer (DiT, adaLN-Zero).

Every attention goes through :class:`omni_core.attention.Attention`, so attention backends, sequence
parallelism and cache backends reach this model exactly as they reach any other. Both are diffusers
``ModelMixin`` + ``ConfigMixin`` models (``save_pretrained`` / ``from_pretrained`` with safetensors).

Hooks for cache backends: the denoiser runs ``embed`` -> ``blocks[i](hidden, temb, context, context_mask)``
-> ``unembed``; ``modulated_input(i, hidden, temb)`` is block ``i``'s modulated input (what TeaCache
compares between steps).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from omni_core.attention import Attention


def sincos_2d(dim: int, grid_h: int, grid_w: int, base: int) -> torch.Tensor:
    """``[grid_h * grid_w, dim]`` 2-D sin-cos position embedding; coordinates are scaled so a grid of any
    size spans the same range as the ``base`` x ``base`` training grid."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    ys = (torch.arange(grid_h, dtype=torch.float64) + 0.5) * base / grid_h
    xs = (torch.arange(grid_w, dtype=torch.float64) + 0.5) * base / grid_w
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    out = []
    for coord in (yy.reshape(-1), xx.reshape(-1)):
        arg = coord[:, None] * omega[None]
        out += [arg.sin(), arg.cos()]
    return torch.cat(out, 1).float()


class MultiHeadAttention(nn.Module):
    """Projections around an Omni ``Attention`` layer (self- or cross-attention), with q/k RMS norm."""

    def __init__(self, dim: int, num_heads: int, context_dim: int | None = None, *, role: str,
                 role_category: str | None = None, skip_sequence_parallel: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        context_dim = context_dim or dim
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(context_dim, dim)
        self.to_v = nn.Linear(context_dim, dim)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=1e-6, elementwise_affine=False)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=1e-6, elementwise_affine=False)
        self.attn = Attention(num_heads, self.head_dim, role=role, role_category=role_category,
                              skip_sequence_parallel=skip_sequence_parallel)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        b, n, _ = x.shape
        q = self.norm_q(self.to_q(x).view(b, n, self.num_heads, self.head_dim))
        k = self.norm_k(self.to_k(context).view(b, context.shape[1], self.num_heads, self.head_dim))
        v = self.to_v(context).view(b, context.shape[1], self.num_heads, self.head_dim)
        out = self.attn(q, k, v, attn_mask=mask)
        return self.to_out(out.reshape(b, n, -1))


class PatchEmbed(nn.Module):
    """Image ``[B, C, H, W]`` -> tokens ``[B, (H/p)(W/p), dim]`` with 2-D sin-cos positions added."""

    def __init__(self, in_channels: int, patch_size: int, dim: int, base_grid: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.base_grid = base_grid
        self.proj = nn.Linear(in_channels * patch_size * patch_size, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        p = self.patch_size
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        pos = sincos_2d(self.proj.out_features, h // p, w // p, self.base_grid).to(x.device, x.dtype)
        return self.proj(x) + pos


class TanhGELU(nn.Module):
    """``GELU(approximate="tanh")`` written as ``x * sigmoid(2u)`` (the same function: ``0.5 (1 + tanh u) =
    sigmoid(2u)``). On CPUs without AVX-512, torch's tanh is slow enough that this form, in place, runs the
    MLP activation ~1.9x faster at the same error against float64 (4.8e-7 max on N(0, 1) inputs); with AVX-512
    torch's fused ``gelu(approximate="tanh")`` is still the slower one (one thread, ``[512, 384]``: 783 us against
    417 us for this form, docs/benchmarks.md, issue #14 seventh round)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training: the out-of-place form autograd can follow
            return x * torch.sigmoid(x * (1.5957691216057308 + 0.07135481627159492 * x * x))
        u = x * x
        u.mul_(0.07135481627159492).add_(1.5957691216057308).mul_(x)  # 2 * sqrt(2/pi) * (x + 0.044715 x^3)
        return torch.sigmoid_(u).mul_(x)


def mlp(dim: int, ratio: float) -> nn.Sequential:
    hidden = int(dim * ratio)
    return nn.Sequential(nn.Linear(dim, hidden), TanhGELU(), nn.Linear(hidden, dim))


class ShapesTextEncoder(ModelMixin, ConfigMixin):
    """A small pre-norm transformer over the closed vocabulary: ids ``[B, L]`` -> states ``[B, L, dim]``."""

    @register_to_config
    def __init__(self, vocab_size: int = 64, max_length: int = 16, dim: int = 128, num_layers: int = 2,
                 num_heads: int = 4, mlp_ratio: float = 2.0) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.randn(1, max_length, dim) * 0.02)
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            layer = nn.Module()
            layer.norm1 = nn.LayerNorm(dim)
            layer.attn = MultiHeadAttention(dim, num_heads, role="text", role_category="self",
                                            skip_sequence_parallel=True)
            layer.norm2 = nn.LayerNorm(dim)
            layer.mlp = mlp(dim, mlp_ratio)
            self.layers.append(layer)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.token_embed(input_ids) + self.pos_embed[:, : input_ids.shape[1]]
        for layer in self.layers:
            x = x + layer.attn(layer.norm1(x), mask=attention_mask)
            x = x + layer.mlp(layer.norm2(x))
        return self.norm_out(x)


def per_sample(module: nn.Module, x: torch.Tensor, enabled: bool) -> torch.Tensor:
    """``module(x)`` for per-sample vectors ``[B, D]``, each row computed as if it were alone when ``enabled``.

    CPU GEMM kernels pick a different code path for very small row counts, so a plain batched call would make
    an image depend (by ~1e-7) on how many others share its batch. A batched matrix multiply of ``B`` one-row
    products runs the one-row kernel for every row: the same bits as a row-by-row loop, in one call instead of
    ``B`` (what a wave of 8 requests with CFG, 16 rows, saves is ~100 small calls per block and step). Token-level
    matmuls have >= 64 rows per image and need no such care.
    """
    if not enabled or x.shape[0] == 1:
        return module(x)
    if isinstance(module, nn.Sequential):
        for layer in module:
            x = per_sample(layer, x, enabled)
        return x
    # a quantized weight (a torchao tensor subclass, omni_core.optimize) supports only what F.linear needs: rows below
    if isinstance(module, nn.Linear) and type(module.weight) in (torch.Tensor, nn.Parameter):
        b = x.shape[0]
        weight = module.weight.t().expand(b, *module.weight.t().shape)
        if module.bias is None:
            return torch.bmm(x[:, None], weight)[:, 0]
        return torch.baddbmm(module.bias.expand(b, 1, -1), x[:, None], weight)[:, 0]
    if isinstance(module, (nn.SiLU, nn.GELU, nn.Identity)):  # element-wise: batch-invariant as it is
        return module(x)
    if isinstance(module, TimestepEmbedding) and module.cond_proj is None and module.post_act is None:
        return per_sample(module.linear_2, module.act(per_sample(module.linear_1, x, enabled)), enabled)
    return torch.cat([module(row) for row in x.split(1)])


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """adaLN-Zero self-attention over image tokens, cross-attention to the text, MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn1 = MultiHeadAttention(dim, num_heads, role="self")
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn2 = MultiHeadAttention(dim, num_heads, role="cross")
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = mlp(dim, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    #: compute per-sample modulation row by row (batch-invariant results; see ``per_sample``)
    batch_invariant: bool = True

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp), each ``[B, dim]``."""
        return per_sample(self.adaLN_modulation, temb, self.batch_invariant).chunk(6, dim=1)

    def forward(self, hidden: torch.Tensor, temb: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(temb)
        hidden = hidden + gate1[:, None] * self.attn1(modulate(self.norm1(hidden), shift1, scale1))
        hidden = hidden + self.attn2(self.norm2(hidden), context, context_mask)
        return hidden + gate2[:, None] * self.mlp(modulate(self.norm3(hidden), shift2, scale2))


class ShapesTransformer2DModel(ModelMixin, ConfigMixin):
    """Text-conditioned DiT in pixel space. ``prediction_type="flow"`` predicts the flow-matching velocity
    ``noise - image``; ``"sample"`` predicts the clean image (see :meth:`velocity`).

    ``forward(hidden_states [B, C, H, W], timestep [B] (sigma * 1000), encoder_hidden_states [B, L, text_dim],
    encoder_mask [B, L] bool)`` -> ``[B, C, H, W]``. The timestep and the masked mean of the text states
    drive the adaLN modulation; the text tokens are also attended to by cross-attention.
    """

    @register_to_config
    def __init__(self, in_channels: int = 3, patch_size: int = 4, sample_size: int = 32, dim: int = 192,
                 num_layers: int = 6, num_heads: int = 6, mlp_ratio: float = 3.0, text_dim: int = 128,
                 prediction_type: str = "flow") -> None:
        super().__init__()
        if prediction_type not in ("flow", "sample"):
            raise ValueError(f"prediction_type must be 'flow' or 'sample', got {prediction_type!r}")
        p = patch_size
        self.x_embed = PatchEmbed(in_channels, p, dim, sample_size // p)
        self.time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embed = TimestepEmbedding(256, dim)
        self.text_pool = nn.Sequential(nn.Linear(text_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.context_proj = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList([DiTBlock(dim, num_heads, mlp_ratio) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.out_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.proj_out = nn.Linear(dim, p * p * in_channels)
        self.initialize_weights()

    @property
    def batch_invariant(self) -> bool:
        """Whether an image's result is independent of the batch it is computed in (inference default);
        training turns it off for speed."""
        return self.blocks[0].batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, value: bool) -> None:
        for block in self.blocks:
            block.batch_invariant = value

    def initialize_weights(self) -> None:
        """DiT's init: xavier linears, zeroed adaLN and output (each block starts as the identity)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.linear_1.weight, std=0.02)
        nn.init.normal_(self.time_embed.linear_2.weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for m in (self.out_modulation[-1], self.proj_out):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    # ---------------------------------------------------------------- pieces (for hooks and cache backends)
    def embed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
              encoder_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (image tokens ``[B, N, dim]``, conditioning ``temb [B, dim]``, text context ``[B, L, dim]``)."""
        b = hidden_states.shape[0]
        tokens = self.x_embed(hidden_states)
        t = self.time_proj(timestep.reshape(-1).expand(b)).to(tokens.dtype)
        if encoder_mask is None:
            pooled = encoder_hidden_states.mean(1)
        else:
            m = encoder_mask.to(encoder_hidden_states.dtype)[..., None]
            pooled = (encoder_hidden_states * m).sum(1) / m.sum(1).clamp(min=1)
        exact = self.batch_invariant
        temb = per_sample(self.time_embed, t, exact) + per_sample(self.text_pool, pooled, exact)
        return tokens, temb, self.context_proj(encoder_hidden_states)

    def modulated_input(self, block_idx: int, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """Block ``block_idx``'s adaLN-modulated input to its self-attention."""
        block = self.blocks[block_idx]
        shift, scale = block.modulation(temb)[:2]
        return modulate(block.norm1(hidden), shift, scale)

    def unembed(self, hidden: torch.Tensor, temb: torch.Tensor, height: int, width: int) -> torch.Tensor:
        shift, scale = per_sample(self.out_modulation, temb, self.batch_invariant).chunk(2, dim=1)
        out = self.proj_out(modulate(self.norm_out(hidden), shift, scale))
        p, c = self.config.patch_size, self.config.in_channels
        b = out.shape[0]
        out = out.reshape(b, height // p, width // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, c, height, width)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_mask: torch.Tensor | None = None) -> torch.Tensor:
        h, w = hidden_states.shape[-2:]
        p = self.config.patch_size
        if h % p or w % p:
            raise ValueError(f"height and width must be multiples of the patch size {p}, got {h}x{w}")
        tokens, temb, context = self.embed(hidden_states, timestep, encoder_hidden_states, encoder_mask)
        for block in self.blocks:
            tokens = block(tokens, temb, context, encoder_mask)
        return self.unembed(tokens, temb, h, w)


def velocity(model_output: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor,
             prediction_type: str) -> torch.Tensor:
    """The flow-matching velocity ``noise - image`` from the model output at noise level ``sigma`` ([B])."""
    if prediction_type == "flow":
        return model_output
    return (sample - model_output) / sigma.reshape(-1, 1, 1, 1)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

