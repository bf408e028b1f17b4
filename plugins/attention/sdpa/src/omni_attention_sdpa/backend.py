"""``TORCH_SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` behind Omni's layout contract."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from omni_core.attention.backend import ALL_FLOAT_DTYPES, AttentionBackend, AttentionImpl


def to_sdpa_mask(attn_mask: torch.Tensor | None, batch: int, seq_k: int) -> torch.Tensor | None:
    """Omni mask -> SDPA mask: a ``[batch, seq_k]`` key-padding mask becomes ``[batch, 1, 1, seq_k]``."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != (batch, seq_k):
            raise ValueError(f"a 2-D attention mask must be a [batch, seq_k] = [{batch}, {seq_k}] key-padding mask, "
                             f"got {tuple(attn_mask.shape)}")
        return attn_mask[:, None, None, :]
    if attn_mask.dim() != 4:
        raise ValueError(f"attention mask must be [batch, seq_k] or 4-D broadcastable to [batch, heads, seq_q, seq_k]"
                         f", got {tuple(attn_mask.shape)}")
    return attn_mask


class TorchSDPAImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.causal and attn_mask is not None:
            raise ValueError("TORCH_SDPA: pass either causal=True or an attention mask, not both")
        mask = to_sdpa_mask(attn_mask, q.shape[0], k.shape[2])
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                             scale=self.softmax_scale)
        return out.transpose(1, 2)

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and float32 log-sum-exp ``[batch, heads, seq_q]`` (what Ring attention merges).

        On CPU the fused flash kernel returns both (about 10x faster than the generic float32 math);
        elsewhere the base class's math is used.
        """
        if query.device.type != "cpu":
            return super().forward_with_lse(query, key, value)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, self.causal, scale=self.softmax_scale)
        return out.transpose(1, 2), lse.float()


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    supported_head_sizes = None
    supported_dtypes = ALL_FLOAT_DTYPES
    supported_devices = ("cpu", "cuda", "npu", "xpu", "mps", "hpu")
    supports_mask = True
    requires = ("torch",)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchSDPAImpl
