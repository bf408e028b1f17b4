"""``TORCH_SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` behind Omni's layout contract.

For Ring attention (``forward_with_lse``) the output and its log-sum-exp come from torch's fused kernels, which
never hold the ``[seq_q, seq_k]`` score matrix: the CPU flash kernel, and on CUDA the flash kernel (fp16/bf16)
or the memory-efficient one (any float dtype), whichever torch says can run the call. Only a call neither
accepts falls back to the base class's float32 math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_core.attention.backend import ALL_FLOAT_DTYPES, AttentionBackend, AttentionImpl
from omni_core.attention.tensors import dense_mask, expand_kv_heads

#: torch's fused kernels and torch's rules for when they run (tests substitute stand-ins for the CUDA ones)
aten = torch.ops.aten
sdpa_checks = torch.backends.cuda


def cpu_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``[B, H, L, D]`` -> (out, lse ``[B, H, Lq]``) from the CPU flash kernel."""
    return tuple(aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2])


def cuda_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``[B, H, L, D]`` -> (out, lse ``[B, H, Lq]``) from the CUDA flash or memory-efficient kernel, or None.

    Called directly, the kernels skip SDPA's head-dim padding, so head dims that are not multiples of 8 are
    left to the fallback. The efficient kernel pads its lse to a multiple of 32 rows; only the first Lq count.
    """
    if q.shape[-1] % 8:
        return None
    params = sdpa_checks.SDPAParams(q, k, v, None, 0.0, causal, False)
    if sdpa_checks.can_use_flash_attention(params):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif sdpa_checks.can_use_efficient_attention(params):
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    else:
        return None
    return out, lse[..., :q.shape[2]]


#: device type -> the fused kernel that returns the log-sum-exp
LSE_KERNELS = {"cpu": cpu_attention_with_lse, "cuda": cuda_attention_with_lse}


class TorchSDPAImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        k, v = expand_kv_heads(k, v, q.shape[1])
        if self.causal and attn_mask is not None:
            raise ValueError("TORCH_SDPA: pass either causal=True or an attention mask, not both")
        mask = dense_mask(attn_mask, q.shape[0], k.shape[2])
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                             scale=self.softmax_scale)
        return out.transpose(1, 2)

    def forward_with_lse(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output and float32 log-sum-exp ``[batch, heads, seq_q]`` (what Ring attention merges), from a fused
        kernel (``LSE_KERNELS``; on CPU about 10x faster than the generic float32 math, on CUDA without its
        quadratic memory); the base class's math only where no kernel takes the call."""
        kernel = LSE_KERNELS.get(query.device.type)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        k, v = expand_kv_heads(k, v, q.shape[1])
        result = kernel(q, k, v, self.causal, self.softmax_scale) if kernel is not None else None
        if result is None:
            return super().forward_with_lse(query, key, value)
        out, lse = result
        return out.transpose(1, 2), lse.float()


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    supported_head_sizes = None
    supported_dtypes = ALL_FLOAT_DTYPES
    supported_devices = ("cpu", "cuda", "npu", "xpu", "mps", "hpu")
    supports_mask = True

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchSDPAImpl
