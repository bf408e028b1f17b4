"""The backend class (what Omni selects) and its implementation (what runs)."""

import torch

from omni_core.attention import AttentionBackend, AttentionImpl
from omni_core.attention.tensors import dense_mask, expand_kv_heads


class ToyAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, attn_mask=None):
        # Omni's layout is [batch, seq, heads, head_dim]; compute in [batch, heads, seq, head_dim], float32
        q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
        k, v = expand_kv_heads(k, v, q.shape[1])  # grouped-query attention: share each key/value head
        scores = q @ k.transpose(-1, -2) * self.softmax_scale
        if attn_mask is not None:
            # [batch, seq_k] key padding (True = attend) -> [batch, 1, 1, seq_k]; wrong shapes raise
            attn_mask = dense_mask(attn_mask, q.shape[0], k.shape[2])
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:  # additive
                scores = scores + attn_mask.float()
        if self.causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return out.transpose(1, 2).to(query.dtype)


class ToyAttentionBackend(AttentionBackend):
    name = "TOY_ATTN"
    supported_dtypes = ("float32", "bfloat16", "float16")
    supported_devices = ("cpu", "cuda")

    @classmethod
    def get_impl_cls(cls):
        return ToyAttentionImpl
