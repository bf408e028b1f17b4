"""The ``Attention`` layer every model uses; it dispatches to the backend chosen for its role."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from omni_core.attention.selector import AttentionSelection, select_attention_backend
from omni_core.config import AttentionConfig, AttentionSpec
from omni_core.errors import ComponentUnavailableError
from omni_core.forward_context import current_config, forward_context


def _load_target(config: Any, dtype: Any, device: Any) -> tuple[Any, Any, Any]:
    """(platform, dtype, device type) the layer will run on: explicit arguments first, else what the config
    being loaded implies (its platform; its dtype, ``auto`` meaning the platform's default dtype, as the
    worker loads it). Without a config only the explicit arguments are known (the current platform decides)."""
    if config is None:
        return None, dtype, device
    from omni_core.platforms import platform_for

    platform = platform_for(config)
    if dtype is None:
        name = getattr(config, "dtype", "auto")
        dtype = platform.default_dtype if name == "auto" else name
    return platform, dtype, device if device is not None else platform.device_type


@torch.compiler.disable
def _run_strategy(strategy: Any, layer: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None) -> torch.Tensor:
    """A sequence-parallel strategy's ``run``, eager under torch.compile: its collectives, Ring's exchange
    handles and host-side mask checks would each break the graph (and Ring's per-block pieces recompile per
    shape); one break around the whole strategy costs less to compile than tracing it (C+ring: ~2x)."""
    return strategy.run(layer, query, key, value, attn_mask)


class Attention(nn.Module):
    """Scaled dot-product attention over ``[batch, seq, heads, head_dim]`` with a declared role.

    ``role`` names the attention site (``"self"``, ``"cross"``, ``"joint"`` or a model-specific string);
    ``role_category`` is the generic role it falls back to in the per-role config. The backend is
    selected when the layer is built, from the ``OmniDiffusionConfig`` being loaded (see
    :func:`omni_core.forward_context.use_config`), for the dtype and device it will run in (``dtype`` /
    ``device``, else the config's dtype on the config's platform), and can be changed later with
    :meth:`set_backend`.
    Sequence-parallel strategies apply inside a sharded region unless ``skip_sequence_parallel``.
    ``replicated_queries``: the queries are whole on every rank while the keys/values are the region's sharded
    tokens (LTX-2's audio attending to its video): the strategy brings every key to the queries' heads.
    """

    def __init__(self, num_heads: int, head_size: int, *, causal: bool = False, softmax_scale: float | None = None,
                 num_kv_heads: int | None = None, role: str = "self", role_category: str | None = None,
                 prefix: str = "", skip_sequence_parallel: bool = False, replicated_queries: bool = False,
                 attention_config: AttentionConfig | None = None, dtype: Any = None, device: Any = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.causal = causal
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_size)
        self.role = role
        self.role_category = role_category
        self.prefix = prefix
        self.skip_sequence_parallel = skip_sequence_parallel
        self.replicated_queries = replicated_queries
        cfg = current_config()
        if attention_config is None:
            attention_config = getattr(cfg, "attention_config", None)
        self._platform, self._dtype, self._device = _load_target(cfg, dtype, device)
        self._select(attention_config)

    def _select(self, attention_config: AttentionConfig | None) -> None:
        self.selection: AttentionSelection = select_attention_backend(
            self.role, head_size=self.head_size, role_category=self.role_category, attention_config=attention_config,
            dtype=self._dtype, device=self._device, causal=self.causal, platform=self._platform)
        self.impl = self.selection.backend_cls.get_impl_cls()(
            self.num_heads, self.head_size, self.softmax_scale, self.causal, self.num_kv_heads,
            **self.selection.spec.options)
        self._checked: set[tuple] = set()

    def split_heads(self, parts: int) -> None:
        """Hold ``1/parts`` of the heads (tensor parallelism split the projections feeding this layer)."""
        if self.num_heads % parts or self.num_kv_heads % parts:
            raise ValueError(f"attention layer {self.prefix or self.role!r}: {parts} ranks cannot split "
                             f"{self.num_heads} heads / {self.num_kv_heads} key-value heads")
        self.num_heads //= parts
        self.num_kv_heads //= parts
        self.impl = self.selection.backend_cls.get_impl_cls()(
            self.num_heads, self.head_size, self.softmax_scale, self.causal, self.num_kv_heads,
            **self.selection.spec.options)

    def set_backend(self, backend: str | AttentionSpec | dict) -> None:
        """Switch this layer to another backend (an explicit choice: errors if it cannot run here)."""
        self._select(AttentionConfig(default=AttentionSpec.coerce(backend)))

    @property
    def backend_name(self) -> str:
        return self.selection.name

    def check_call(self, query: torch.Tensor, attn_mask: Any) -> None:
        """Raise if the backend cannot run this call. Eagerly the answer is memoised per (dtype, device, mask);
        under torch.compile the check runs at trace time on constants instead (dynamo would guard on the memo
        set, and its first ``add`` would fail that guard: one more compile of the whole block per key)."""
        key = (query.dtype, query.device.type, attn_mask is not None)
        compiling = torch.compiler.is_compiling()
        if not compiling and key in self._checked:
            return
        why = self.selection.backend_cls.check_call(query.dtype, query.device.type, attn_mask is not None, self.causal)
        if why:
            raise ComponentUnavailableError(
                f"attention layer {self.prefix or self.role!r} (role {self.role!r}, backend chosen by "
                f"{self.selection.source}): {why}")
        if not compiling:
            self._checked.add(key)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if query.dim() != 4:
            raise ValueError(f"Attention expects [batch, seq, heads, head_dim] inputs, got shape {tuple(query.shape)}")
        self.check_call(query, attn_mask)
        strategy = forward_context().attn_strategy
        if strategy is not None and not self.skip_sequence_parallel:
            return _run_strategy(strategy, self, query, key, value, attn_mask)
        return self.impl.forward(query, key, value, attn_mask)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_size={self.head_size}, role={self.role!r}, "
                f"backend={self.backend_name} ({self.selection.source})")
