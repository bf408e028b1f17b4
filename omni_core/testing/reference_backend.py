"""``TESTING_REFERENCE``: a minimal ``torch.nn.functional.scaled_dot_product_attention`` kernel for tests run
without an attention plugin (registered by :mod:`omni_core.testing.tiny_dit_plugin` only where
``omni-attention-sdpa`` is not installed; its record is portable, so the platform's default picks it there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_core.attention.backend import ALL_FLOAT_DTYPES, AttentionBackend, AttentionImpl
from omni_core.attention.tensors import dense_mask, expand_kv_heads


class ReferenceImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        k, v = expand_kv_heads(k, v, q.shape[1])
        mask = dense_mask(attn_mask, q.shape[0], k.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                             scale=self.softmax_scale)
        return out.transpose(1, 2)


class ReferenceBackend(AttentionBackend):
    name = "TESTING_REFERENCE"
    supported_dtypes = ALL_FLOAT_DTYPES
    supported_devices = ("cpu", "cuda")
    supports_mask = True
    requires = ("torch",)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return ReferenceImpl
