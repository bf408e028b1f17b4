"""Attention backend contract tests: a backend must match torch SDPA's math within a tolerance.

A plugin's test module subclasses :class:`AttentionBackendContract` and sets ``backend_name``::

    from omni_core.testing import AttentionBackendContract

    class TestFlashContract(AttentionBackendContract):
        backend_name = "FLASH_ATTN"
        tolerances = {"bfloat16": (3e-2, 3e-2)}   # optional: per-dtype (atol, rtol) overrides

The reference is ``torch.nn.functional.scaled_dot_product_attention`` computed in float64 on the CPU from the
very inputs the backend received. Every check goes through the ``Attention`` layer, so selection, the
layer's dtype/device checks and the backend's ``AttentionImpl`` are all exercised. A backend that is not
usable here (library missing, no device) is skipped with the reason; a dtype or device it does not
declare is checked to raise a clear :class:`~omni_core.errors.ComponentUnavailableError` instead.

No torch at import: the test methods import it when they run.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

#: name -> (batch, seq_q, seq_k, heads, kv_heads, head_dim)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "square": (2, 16, 16, 4, 4, 32),
    "cross": (2, 8, 24, 4, 4, 64),  # seq_q != seq_k, as in cross-attention to text tokens
    "gqa": (1, 12, 12, 8, 2, 32),  # grouped-query: 8 query heads share 2 key/value heads
    "odd": (3, 7, 5, 3, 3, 40),
    "single_query": (1, 1, 9, 2, 2, 16),
}
MASK_SHAPES = ("cross", "gqa")
CAUSAL_SHAPES = ("square", "gqa")  # causal is defined top-left aligned; checked where seq_q == seq_k
DTYPES = ("float32", "bfloat16", "float16")
#: dtype -> (atol, rtol) of the backend output against the float64 reference
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (2e-5, 1e-4),
    "bfloat16": (2e-2, 2e-2),
    "float16": (3e-3, 3e-3),
}


def reference_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, *, causal: bool = False,
                        scale: float | None = None) -> Any:
    """Attention in Omni's layout (``[batch, seq, heads, head_dim]``), computed by torch SDPA in float64 on CPU.

    ``attn_mask`` follows the backend contract: bool ``[batch, seq_k]`` key padding (True = attend), or a
    bool/additive mask broadcastable to ``[batch, heads, seq_q, seq_k]``. Returns float64 on the CPU.
    """
    import torch
    import torch.nn.functional as F

    from omni_core.attention.tensors import dense_mask, expand_kv_heads

    q, k, v = (t.detach().to("cpu", torch.float64).transpose(1, 2) for t in (query, key, value))
    k, v = expand_kv_heads(k, v, q.shape[1])
    mask = None
    if attn_mask is not None:
        mask = dense_mask(attn_mask.detach().to("cpu"), q.shape[0], k.shape[2])
        if mask.dtype != torch.bool:
            mask = mask.to(torch.float64)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def reference_lse(query: Any, key: Any, *, causal: bool = False, scale: float) -> Any:
    """Log-sum-exp of the attention scores, ``[batch, heads, seq_q]``, float64 on CPU."""
    import torch

    from omni_core.attention.tensors import expand_heads

    q, k = (t.detach().to("cpu", torch.float64).transpose(1, 2) for t in (query, key))
    k = expand_heads(k, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def ring_merge(impl: Any, query: Any, key: Any, value: Any, blocks: int) -> Any:
    """Ring attention's arithmetic in one process: keys/values cut into ``blocks`` consecutive blocks, each
    block's partial from ``impl.forward_with_lse`` (through ``attention_with_lse``), merged by log-sum-exp as
    ``RingAttention`` merges the blocks it receives from the other ranks. Returns the output in query's dtype."""
    from omni_core.attention.parallel import attention_with_lse, merge_partials

    acc = None
    for kb, vb in zip(key.tensor_split(blocks, dim=1), value.tensor_split(blocks, dim=1)):
        acc = merge_partials(acc, attention_with_lse(impl, query, kb, vb))
    return acc[0].to(query.dtype)


class AttentionBackendContract:
    """Contract tests every attention backend must pass. Subclass it in a ``Test*`` class."""

    #: the component name the backend is registered under
    backend_name: ClassVar[str] = ""
    #: dtypes to check (each is skipped where the device cannot compute in it)
    dtypes: ClassVar[tuple[str, ...]] = DTYPES
    #: torch device types to check; None = "cpu" plus "cuda" when torch sees a GPU
    devices: ClassVar[tuple[str, ...] | None] = None
    #: per-dtype (atol, rtol) overrides, merged over DEFAULT_TOLERANCES
    tolerances: ClassVar[dict[str, tuple[float, float]]] = {}
    seed: ClassVar[int] = 0
    #: a fixture set up before the backend loads, e.g. one substituting a reference kernel for a GPU library so
    #: the contract runs on the CPU through the backend's own adapter code (``None``: the backend as installed)
    kernel_fixture: ClassVar[str | None] = None

    # ------------------------------------------------------------------ parametrisation
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "device" in metafunc.fixturenames:
            metafunc.parametrize("device", self._candidate_devices())
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes)

    def _candidate_devices(self) -> tuple[str, ...]:
        if self.devices is not None:
            return tuple(self.devices)
        import torch

        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)

    # ------------------------------------------------------------------ fixtures and helpers
    @pytest.fixture
    def backend(self, omni_plugin_manager: Any, request: pytest.FixtureRequest) -> Any:
        """The backend class, loaded through a fresh strict plugin manager (after ``kernel_fixture``); skipped if
        not usable here."""
        from omni_core.attention.selector import load_backend
        from omni_core.plugins.availability import check_component

        if not self.backend_name:
            pytest.fail(f"{type(self).__name__} must set backend_name")
        if self.kernel_fixture:
            request.getfixturevalue(self.kernel_fixture)
        cls = load_backend(self.backend_name, omni_plugin_manager)  # a broken plugin fails, an absent library skips
        av = check_component("attention", self.backend_name, pm=omni_plugin_manager)  # no context: up to is_available
        if not av.ok:
            pytest.skip(f"{self.backend_name} is not usable here: {av.reason}")
        return cls

    def tolerance(self, dtype: str) -> tuple[float, float]:
        return {**DEFAULT_TOLERANCES, **self.tolerances}[dtype]

    def require(self, backend: Any, dtype: str, device: str) -> None:
        """Skip (with the reason) combinations the backend does not declare or the machine cannot run."""
        import torch

        if device not in backend.supported_devices:
            pytest.skip(f"{self.backend_name} does not declare device {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if dtype not in backend.supported_dtypes:
            pytest.skip(f"{self.backend_name} does not declare dtype {dtype}")
        try:
            torch.ones(2, 2, dtype=getattr(torch, dtype), device=device) @ torch.ones(
                2, 2, dtype=getattr(torch, dtype), device=device)
        except (RuntimeError, TypeError) as exc:
            pytest.skip(f"device {device!r} cannot compute in {dtype}: {exc}")

    @staticmethod
    def preferred_dtype(backend: Any) -> str:
        """float32 where the backend takes it, else its first declared dtype (fp16/bf16-only kernels)."""
        return "float32" if "float32" in backend.supported_dtypes else backend.supported_dtypes[0]

    @staticmethod
    def fit_head_size(backend: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` with its head size replaced by one the backend supports (for checks about other things)."""
        if backend.check_head_size(shape[-1]) is None or not backend.supported_head_sizes:
            return shape
        return (*shape[:-1], backend.supported_head_sizes[0])

    def require_head_size(self, backend: Any, head_dim: int) -> None:
        why = backend.check_head_size(head_dim)
        if why:
            pytest.skip(why)

    def inputs(self, shape: tuple[int, ...], dtype: str, device: str) -> tuple[Any, Any, Any]:
        import torch

        batch, seq_q, seq_k, heads, kv_heads, head_dim = shape
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(batch, seq_q, heads, head_dim, generator=g)
        k = torch.randn(batch, seq_k, kv_heads, head_dim, generator=g)
        v = torch.randn(batch, seq_k, kv_heads, head_dim, generator=g)
        return tuple(t.to(device=device, dtype=getattr(torch, dtype)) for t in (q, k, v))

    def layer(self, shape: tuple[int, ...], *, causal: bool = False, role: str = "self",
              role_category: str | None = None, attention_config: Any = None) -> Any:
        from omni_core.attention.layer import Attention
        from omni_core.config import AttentionConfig

        _, _, _, heads, kv_heads, head_dim = shape
        if attention_config is None:
            attention_config = AttentionConfig(default=self.backend_name)
        return Attention(heads, head_dim, num_kv_heads=kv_heads, causal=causal, role=role,
                         role_category=role_category, attention_config=attention_config)

    def check_close(self, out: Any, query: Any, key: Any, value: Any, dtype: str, *, attn_mask: Any = None,
                    causal: bool = False, scale: float | None = None, what: str = "") -> None:
        import torch

        assert out.shape == query.shape, f"output shape {tuple(out.shape)} != query shape {tuple(query.shape)}"
        assert out.dtype == query.dtype, f"output dtype {out.dtype} != input dtype {query.dtype}"
        assert out.device == query.device, f"output device {out.device} != input device {query.device}"
        ref = reference_attention(query, key, value, attn_mask, causal=causal, scale=scale)
        atol, rtol = self.tolerance(dtype)
        torch.testing.assert_close(out.detach().to("cpu", torch.float64), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{self.backend_name} vs torch SDPA reference ({what}, {dtype}): {m}")

    def run_layer(self, layer: Any, q: Any, k: Any, v: Any, attn_mask: Any = None) -> Any:
        import torch

        with torch.no_grad():
            return layer(q, k, v, attn_mask=attn_mask)

    # ------------------------------------------------------------------ the contract
    def test_registered_backend_describes_itself(self, backend: Any) -> None:
        from omni_core.attention.backend import ALL_FLOAT_DTYPES, AttentionBackend, AttentionImpl

        assert issubclass(backend, AttentionBackend)
        assert backend.name == self.backend_name, "the class's name must be the component name it is registered as"
        assert issubclass(backend.get_impl_cls(), AttentionImpl)
        assert set(backend.supported_dtypes) <= set(ALL_FLOAT_DTYPES) | {"float64"}, backend.supported_dtypes
        assert backend.supported_devices, "supported_devices must not be empty"

    @pytest.mark.parametrize("shape_name", list(SHAPES))
    def test_matches_reference(self, backend: Any, shape_name: str, dtype: str, device: str) -> None:
        shape = SHAPES[shape_name]
        self.require(backend, dtype, device)
        self.require_head_size(backend, shape[-1])
        q, k, v = self.inputs(shape, dtype, device)
        layer = self.layer(shape).to(device)
        out = self.run_layer(layer, q, k, v)
        self.check_close(out, q, k, v, dtype, scale=layer.softmax_scale, what=shape_name)

    @pytest.mark.parametrize("shape_name", MASK_SHAPES)
    def test_key_padding_mask(self, backend: Any, shape_name: str, dtype: str, device: str) -> None:
        import torch

        shape = SHAPES[shape_name]
        self.require(backend, dtype, device)
        self.require_head_size(backend, shape[-1])
        if not backend.supports_mask:
            pytest.skip(f"{self.backend_name} declares supports_mask=False (checked by test_mask_refused)")
        batch, _, seq_k = shape[:3]
        g = torch.Generator().manual_seed(self.seed + 1)
        mask = torch.rand(batch, seq_k, generator=g) < 0.6
        mask[torch.arange(batch), torch.randint(seq_k, (batch,), generator=g)] = True  # >= 1 key per row
        mask[0, seq_k // 2:] = False  # a padded tail, the usual case
        mask[0, 0] = True
        q, k, v = self.inputs(shape, dtype, device)
        layer = self.layer(shape).to(device)
        out = self.run_layer(layer, q, k, v, mask.to(device))
        self.check_close(out, q, k, v, dtype, attn_mask=mask, scale=layer.softmax_scale,
                         what=f"{shape_name}, key-padding mask")

    @pytest.mark.parametrize("mask_kind", ["bool_per_batch", "bool_per_head", "additive"])
    @pytest.mark.parametrize("shape_name", MASK_SHAPES)
    def test_4d_mask(self, backend: Any, shape_name: str, mask_kind: str, dtype: str, device: str) -> None:
        import torch

        shape = SHAPES[shape_name]
        self.require(backend, dtype, device)
        self.require_head_size(backend, shape[-1])
        if not backend.supports_mask:
            pytest.skip(f"{self.backend_name} declares supports_mask=False (checked by test_mask_refused)")
        batch, seq_q, seq_k, heads = shape[:4]
        g = torch.Generator().manual_seed(self.seed + 2)
        if mask_kind == "additive":
            mask = (torch.randn(batch, 1, seq_q, seq_k, generator=g) * 2).to(getattr(torch, dtype))
        else:
            mask = torch.rand(batch, heads if mask_kind == "bool_per_head" else 1, seq_q, seq_k, generator=g) < 0.6
            mask[..., 0] = True  # every query sees at least one key
        q, k, v = self.inputs(shape, dtype, device)
        layer = self.layer(shape).to(device)
        out = self.run_layer(layer, q, k, v, mask.to(device))
        self.check_close(out, q, k, v, dtype, attn_mask=mask, scale=layer.softmax_scale,
                         what=f"{shape_name}, {mask_kind} mask")

    def test_bad_mask_shape_raises(self, backend: Any) -> None:
        import torch

        if not backend.supports_mask:
            pytest.skip(f"{self.backend_name} declares supports_mask=False")
        shape = SHAPES["cross"]
        self.require(backend, "float32", "cpu")
        q, k, v = self.inputs(shape, "float32", "cpu")
        bad = torch.ones(shape[0], shape[2] + 3, dtype=torch.bool)  # seq_k is wrong
        with pytest.raises((ValueError, RuntimeError)):
            self.run_layer(self.layer(shape), q, k, v, bad)

    @pytest.mark.parametrize("shape_name", CAUSAL_SHAPES)
    def test_causal(self, backend: Any, shape_name: str, dtype: str, device: str) -> None:
        shape = SHAPES[shape_name]
        self.require(backend, dtype, device)
        self.require_head_size(backend, shape[-1])
        if not backend.supports_causal:
            pytest.skip(f"{self.backend_name} declares supports_causal=False (checked by test_causal_refused)")
        q, k, v = self.inputs(shape, dtype, device)
        layer = self.layer(shape, causal=True).to(device)
        out = self.run_layer(layer, q, k, v)
        self.check_close(out, q, k, v, dtype, causal=True, scale=layer.softmax_scale, what=f"{shape_name}, causal")

    @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
    def test_forward_with_lse(self, backend: Any, causal: bool, device: str) -> None:
        import torch

        shape = self.fit_head_size(backend, SHAPES["gqa"])
        dtype = self.preferred_dtype(backend)
        self.require(backend, dtype, device)
        self.require_head_size(backend, shape[-1])
        if causal and not backend.supports_causal:
            pytest.skip(f"{self.backend_name} declares supports_causal=False")
        q, k, v = self.inputs(shape, dtype, device)
        layer = self.layer(shape, causal=causal).to(device)
        with torch.no_grad():
            out, lse = layer.impl.forward_with_lse(q, k, v)
        self.check_close(out, q, k, v, dtype, causal=causal, scale=layer.softmax_scale, what="forward_with_lse")
        assert tuple(lse.shape) == (shape[0], shape[3], shape[1]), f"lse shape {tuple(lse.shape)}"
        tol = max(1e-4, self.tolerance(dtype)[0])
        torch.testing.assert_close(lse.to("cpu", torch.float64),
                                   reference_lse(q, k, causal=causal, scale=layer.softmax_scale), atol=tol, rtol=tol)

    def test_ring_blocks_merge_to_full_attention(self, backend: Any, device: str) -> None:
        """Under Ring attention each key/value block's partial (``forward_with_lse``) is merged by log-sum-exp;
        three blocks merged must equal attention over all keys."""
        import torch

        shape = self.fit_head_size(backend, SHAPES["cross"])
        dtype = self.preferred_dtype(backend)
        self.require(backend, dtype, device)
        self.require_head_size(backend, shape[-1])
        q, k, v = self.inputs(shape, dtype, device)
        layer = self.layer(shape).to(device)
        with torch.no_grad():
            out = ring_merge(layer.impl, q, k, v, blocks=3)
        self.check_close(out, q, k, v, dtype, scale=layer.softmax_scale, what="ring blocks merged by lse")

    def test_roles_select_this_backend(self, backend: Any, device: str) -> None:
        """Per-role configuration reaches the backend: by role, by role category, and through ``use_config``."""
        from omni_core.config import AttentionConfig, OmniDiffusionConfig
        from omni_core.forward_context import use_config

        dtype = self.preferred_dtype(backend)
        self.require(backend, dtype, device)
        shape = self.fit_head_size(backend, SHAPES["cross"])
        self.require_head_size(backend, shape[-1])
        cfg = AttentionConfig(per_role={"cross": self.backend_name})  # other roles: the platform's default
        by_role = self.layer(shape, role="cross", attention_config=cfg)
        by_category = self.layer(shape, role="wan.attn2", role_category="cross", attention_config=cfg)
        with use_config(OmniDiffusionConfig(model="contract-test", attention_config=cfg, dtype=dtype)):
            from omni_core.attention.layer import Attention

            from_context = Attention(shape[3], shape[5], num_kv_heads=shape[4], role="cross")
        assert by_role.backend_name == self.backend_name and by_role.selection.source == "per_role['cross']"
        assert by_category.backend_name == self.backend_name
        assert by_category.selection.source == "per_role['cross'] (role category)"
        assert from_context.backend_name == self.backend_name
        q, k, v = self.inputs(shape, dtype, device)
        for layer in (by_role, by_category, from_context):
            out = self.run_layer(layer.to(device), q, k, v)
            self.check_close(out, q, k, v, dtype, scale=layer.softmax_scale, what=f"role {layer.role!r}")

    @pytest.mark.parametrize("dtype_name", ["float64", *DTYPES])
    def test_undeclared_dtype_raises_clearly(self, backend: Any, dtype_name: str) -> None:
        import torch

        from omni_core.errors import ComponentUnavailableError

        if dtype_name in backend.supported_dtypes:
            pytest.skip(f"{self.backend_name} declares {dtype_name}")
        shape = self.fit_head_size(backend, SHAPES["square"])
        q, k, v = (t.to(getattr(torch, dtype_name)) for t in self.inputs(shape, "float32", "cpu"))
        with pytest.raises(ComponentUnavailableError, match=dtype_name):
            self.run_layer(self.layer(shape), q, k, v)

    def test_undeclared_device_raises_clearly(self, backend: Any) -> None:
        import torch

        from omni_core.errors import ComponentUnavailableError

        if "meta" in backend.supported_devices:
            pytest.skip(f"{self.backend_name} declares the meta device")
        shape = self.fit_head_size(backend, SHAPES["square"])
        q, k, v = (t.to("meta") for t in self.inputs(shape, "float32", "cpu"))
        dtype = backend.supported_dtypes[0]
        q, k, v = (t.to(getattr(torch, dtype)) for t in (q, k, v))
        with pytest.raises(ComponentUnavailableError, match="meta"):
            self.run_layer(self.layer(shape).to("meta"), q, k, v)

    def test_mask_refused_when_unsupported(self, backend: Any) -> None:
        import torch

        from omni_core.errors import ComponentUnavailableError

        if backend.supports_mask:
            pytest.skip(f"{self.backend_name} supports masks")
        shape = SHAPES["cross"]
        dtype = backend.supported_dtypes[0]
        q, k, v = self.inputs(shape, dtype, backend.supported_devices[0])
        mask = torch.ones(shape[0], shape[2], dtype=torch.bool, device=q.device)
        with pytest.raises(ComponentUnavailableError, match="mask"):
            self.run_layer(self.layer(shape).to(q.device), q, k, v, mask)

    def test_causal_refused_when_unsupported(self, backend: Any) -> None:
        from omni_core.errors import ComponentUnavailableError

        if backend.supports_causal:
            pytest.skip(f"{self.backend_name} supports causal attention")
        shape = SHAPES["square"]
        q, k, v = self.inputs(shape, backend.supported_dtypes[0], backend.supported_devices[0])
        with pytest.raises(ComponentUnavailableError, match="causal"):
            self.run_layer(self.layer(shape, causal=True).to(q.device), q, k, v)
