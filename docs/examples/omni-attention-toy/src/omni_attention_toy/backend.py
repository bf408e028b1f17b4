"""The backend class (what Omni selects) and its implementation (what runs)."""

import torch

from omni_core.attention import AttentionBackend, AttentionImpl


class ToyAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, attn_mask=None):
        # Omni's layout is [batch, seq, heads, head_dim]; compute in [batch, heads, seq, head_dim], float32
        q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each key/value head
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) * self.softmax_scale
        if attn_mask is not None:
            if attn_mask.dim() == 2:  # [batch, seq_k] key padding, True = attend
                if attn_mask.shape != (q.shape[0], k.shape[2]):
                    raise ValueError(f"key-padding mask must be [batch, seq_k], got {tuple(attn_mask.shape)}")
                attn_mask = attn_mask[:, None, None, :]
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
    requires = ("torch",)

    @classmethod
    def get_impl_cls(cls):
        return ToyAttentionImpl
