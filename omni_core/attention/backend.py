"""Attention backend and implementation interfaces (what a kernel plugin implements).

Layout contract: query ``[batch, seq_q, heads, head_dim]``, key/value ``[batch, seq_k, kv_heads, head_dim]``,
output ``[batch, seq_q, heads, head_dim]``. ``attn_mask`` is optional and is either a boolean key-padding
mask ``[batch, seq_k]`` (True = attend) or a boolean/additive mask broadcastable to
``[batch, heads, seq_q, seq_k]``. A backend that cannot honour a mask must raise, never ignore it.
``causal`` means query ``i`` attends keys ``0..i`` (top-left aligned, as torch's SDPA).
This module does not import torch.
"""

from __future__ import annotations

from typing import Any, ClassVar

ALL_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"`` (and strings pass through)."""
    s = str(dtype)
    return s[6:] if s.startswith("torch.") else s


class AttentionImpl:
    """One attention computation, configured for a layer. Subclasses implement ``forward``."""

    def __init__(self, num_heads: int, head_size: int, softmax_scale: float, causal: bool = False,
                 num_kv_heads: int | None = None, **options: Any) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.num_kv_heads = num_kv_heads or num_heads
        self.options = options

    def forward(self, query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
        raise NotImplementedError

    def forward_with_lse(self, query: Any, key: Any, value: Any) -> tuple[Any, Any]:
        """Output plus log-sum-exp ``[batch, heads, seq_q]`` (float32); needed by Ring attention.

        The default computes it with plain torch math so that every backend can sit under Ring.
        """
        import torch

        from omni_core.attention.tensors import expand_kv_heads

        q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
        k, v = expand_kv_heads(k, v, q.shape[1])
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if self.causal:
            sq, sk = scores.shape[-2:]
            # top-left aligned, as torch's SDPA (the reference): query i sees keys 0..i
            mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.transpose(1, 2).to(query.dtype), lse


class AttentionBackend:
    """Static description of a kernel: what it supports and which ``AttentionImpl`` runs it."""

    #: the component name, used in reasons; the registration record states it and this must agree
    name: ClassVar[str] = ""
    #: head sizes the kernel accepts; None = any
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_dtypes: ClassVar[tuple[str, ...]] = ALL_FLOAT_DTYPES
    #: torch device types the kernel runs on
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_mask: ClassVar[bool] = True
    supports_causal: ClassVar[bool] = True

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        raise NotImplementedError

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether the kernel library works here (device checks come per call). The record's ``requires`` are
        checked before the class is imported (:func:`omni_core.plugins.availability.check_record`); override
        for what they cannot tell (a version, a build for this torch)."""
        return True, ""

    @classmethod
    def check_capability(cls, capability: tuple[int, int]) -> str | None:
        """Why the kernel does not run on a GPU of this compute capability ``(major, minor)``, or None.

        Kernel libraries are built for a list of architectures and fail only at their first forward elsewhere;
        GPU platforms ask this (where the device is known) before choosing a backend by default.
        """
        return None

    @classmethod
    def check_head_size(cls, head_size: int) -> str | None:
        if cls.supported_head_sizes is not None and head_size not in cls.supported_head_sizes:
            return (f"{cls.name} does not support head size {head_size}; supported: "
                    f"{', '.join(map(str, cls.supported_head_sizes))}")
        return None

    @classmethod
    def check_call(cls, dtype: Any, device_type: str, has_mask: bool, causal: bool) -> str | None:
        """Why this call cannot run on this backend, or None."""
        dt = dtype_name(dtype)
        if dt not in cls.supported_dtypes:
            return f"{cls.name} does not support dtype {dt}; supported: {', '.join(cls.supported_dtypes)}"
        if device_type not in cls.supported_devices:
            return (f"{cls.name} does not run on device type {device_type!r}; supported: "
                    f"{', '.join(cls.supported_devices)}")
        if has_mask and not cls.supports_mask:
            return f"{cls.name} does not support attention masks"
        if causal and not cls.supports_causal:
            return f"{cls.name} does not support causal attention"
        return None
