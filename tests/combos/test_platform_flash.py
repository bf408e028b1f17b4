"""Platform plugins together with the plugins they defer to (FLASH_ATTN, a second platform).

These combine distributions, so they live here rather than in one plugin's tests (each plugin's own tests
pass with that plugin installed alone); each skips when a distribution it needs is not installed.
"""

from __future__ import annotations

import pytest

from omni_core.platforms import PlatformResolutionError, resolve_platform
from omni_core.plugins.manager import OmniPluginManager, set_plugin_manager

cp = pytest.importorskip("omni_platform_cuda.platform")
cuda_hooks = pytest.importorskip("omni_platform_cuda.hooks")

CUDA_BOX = cp.CudaProbe("2.8.0+cu128", "12.8", None, 2)


def fresh_pm(*plugins: tuple[object, str, str]) -> OmniPluginManager:
    """Built-ins plus exactly the given ``(module, entry point name, distribution)`` plugins."""
    pm = OmniPluginManager(strict=True)
    pm.load_builtins()
    for module, name, dist in plugins:
        pm.register_plugin(module, name, dist=dist)
    return pm


def flash_usable(head_size, dtype, capability=None):
    """FLASH_ATTN's own verdict, by the availability walk the platform's default choice runs."""
    from omni_core.plugins.availability import Context, check_component

    av = check_component("attention", "FLASH_ATTN", Context(device_type="cuda", dtype=dtype, head_size=head_size,
                                                             capability=capability))
    return av.ok, av.reason


def flash_and_sdpa():
    import omni_attention_flash.hooks as flash_hooks
    import omni_attention_sdpa.hooks as sdpa_hooks

    return fresh_pm((flash_hooks, "attention-flash", "omni-attention-flash"),
                    (sdpa_hooks, "attention-sdpa", "omni-attention-sdpa"))


def test_flash_usability_asks_the_flash_plugin(monkeypatch):
    """The platform's default defers to FLASH_ATTN's own rules: installed and importable, head size, dtype."""
    from omni_core.errors import ComponentUnavailableError

    fb = pytest.importorskip("omni_attention_flash.backend")
    pytest.importorskip("omni_attention_sdpa")
    monkeypatch.setattr(cp.CudaPlatform, "fast_attention_capabilities", None)  # the arch rules: tests below
    previous = set_plugin_manager(flash_and_sdpa())
    try:
        if not fb.FlashAttentionBackend.is_available()[0]:
            ok, why = flash_usable(64, "bfloat16")
            assert not ok and "no flash attention library" in why
            assert cp.CudaPlatform().default_attention_backend(64, "bfloat16") == "TORCH_SDPA"
        monkeypatch.setattr(fb.FlashAttentionBackend, "is_available", classmethod(lambda cls: (True, "")))
        assert flash_usable(64, "bfloat16") == (True, "")
        assert flash_usable(128, "float16") == (True, "")
        assert cp.CudaPlatform().default_attention_backend(64, "bfloat16") == "FLASH_ATTN"
        ok, why = flash_usable(100, "bfloat16")
        assert not ok and "head size 100" in why
        assert cp.CudaPlatform().default_attention_backend(100, "bfloat16") == "TORCH_SDPA"
        ok, why = flash_usable(64, "float32")
        assert not ok and "float32" in why
        assert cp.CudaPlatform().default_attention_backend(64, "float32") == "TORCH_SDPA"
        set_plugin_manager(fresh_pm())  # no attention plugin installed: the error names the missing kind
        with pytest.raises(ComponentUnavailableError, match="no attention backend plugin is installed.*"
                                                            "plugin kind 'attention'"):
            cp.CudaPlatform().default_attention_backend(64, "bfloat16")
    finally:
        set_plugin_manager(previous)


def test_two_detected_platforms_are_an_error_naming_both(monkeypatch):
    npu = pytest.importorskip("omni_platform_npu.platform")
    import omni_platform_npu.hooks as npu_hooks

    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    monkeypatch.setattr(cp, "probe", lambda: CUDA_BOX)
    monkeypatch.setattr(npu, "probe", lambda: npu.NpuProbe(True, ("/dev/davinci0",)))
    pm = fresh_pm((cuda_hooks, "platform-cuda", "omni-platform-cuda"),
                  (npu_hooks, "platform-npu", "omni-platform-npu"))
    with pytest.raises(PlatformResolutionError, match="several platforms detected") as info:
        resolve_platform(pm)
    assert "cuda (omni-platform-cuda)" in str(info.value) and "npu (omni-platform-npu)" in str(info.value)
    assert "OMNI_PLATFORM" in str(info.value)
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")  # the way out the message names
    assert resolve_platform(pm).name == "cuda"


def test_flash_usability_here():
    pytest.importorskip("omni_attention_flash.backend")
    from omni_attention_flash.backend import FlashAttentionBackend

    if FlashAttentionBackend.is_available()[0]:
        pytest.skip("a flash attention library is usable here")
    ok, why = flash_usable(64, "bfloat16")
    assert not ok and why


# ---------------------------------------------------------------- the flash plugin's architecture rules
def _fa3_module():
    """A stand-in ``flash_attn_interface`` with FA3's signatures (no ``dropout_p``)."""
    import types

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False): ...

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False): ...

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
                                 __version__="3.0.0b1")


@pytest.mark.parametrize(("cap", "expected", "reason"), [
    ((7, 5), "TORCH_SDPA", "FlashAttention-3 needs an Ampere or newer GPU (compute capability >= 8.0), this GPU is sm75"),
    ((8, 0), "FLASH_ATTN", ""),
    ((8, 9), "FLASH_ATTN", ""),
    ((9, 0), "FLASH_ATTN", ""),
])
def test_only_fa3_installed_is_the_default_on_ampere_and_newer(monkeypatch, cap, expected, reason):
    """Current FA3 runs on sm80+ (``hopper/flash_api.cpp``: ``is_sm8x = major >= 8``; it was sm90-only before,
    issue #36): the platform picks FA3 alone there, and below sm80 the flash plugin says why not."""
    import torch

    fb = pytest.importorskip("omni_attention_flash.backend")
    pytest.importorskip("omni_attention_sdpa")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(fb, "_module_present", lambda name: name == "flash_attn_interface")
    monkeypatch.setattr(fb, "_imported", {"flash_attn_interface": _fa3_module()})
    monkeypatch.setattr(fb, "initialised_capability", lambda: None)
    monkeypatch.setattr(cp.CudaPlatform, "capability", lambda self, device=None: cap)
    previous = set_plugin_manager(flash_and_sdpa())
    try:
        assert fb.FlashAttentionBackend.is_available() == (True, "")  # installed and importable
        assert cp.CudaPlatform().default_attention_backend(128, torch.bfloat16) == expected
        ok, why = flash_usable(128, "bfloat16", cap)
        assert ok is (expected == "FLASH_ATTN") and reason in why
        if reason:
            assert "flash_attn is not installed" in why  # and which library would serve this GPU
    finally:
        set_plugin_manager(previous)


# ---------------------------------------------------------------- one CUDA-like base
def test_cuda_and_rocm_are_thin_subclasses_of_the_core_base():
    """The torch.cuda methods and the default-kernel choice live once, in the core; each plugin declares what
    differs (name, detection, where a fast kernel may be the default)."""
    from omni_core.platforms.cuda_like import CudaLikePlatform

    rp = pytest.importorskip("omni_platform_rocm.platform")
    shared = ("set_device", "synchronize", "empty_cache", "memory_stats", "capability", "fast_attention_allowed",
              "default_attention_backend", "device_type", "dist_backend", "default_dtype")
    for cls in (cp.CudaPlatform, rp.RocmPlatform):
        assert issubclass(cls, CudaLikePlatform)
        assert not set(shared) & set(vars(cls)), cls
        assert set(vars(cls)) - {"__module__", "__doc__", "__qualname__"} <= {
            "name", "fast_attention_capabilities", "is_available", "device_count", "__firstlineno__", "__static_attributes__"}
    assert cp.CudaPlatform.fast_attention_capabilities == ((8, 0), (9, 0))
    assert rp.RocmPlatform.fast_attention_capabilities is None


def test_rocm_asks_no_capability(monkeypatch):
    """ROCm does not bound fast kernels by compute capability, so it never initialises the device to ask."""
    rp = pytest.importorskip("omni_platform_rocm.platform")

    def boom(self, device=None):
        raise AssertionError("capability asked")

    monkeypatch.setattr(rp.RocmPlatform, "capability", boom)
    from omni_core.testing.kernel_stand_ins import FAST, stand_in_kernels

    with stand_in_kernels() as asked:
        assert rp.RocmPlatform().default_attention_backend(64, None) == FAST
    assert asked == [(64, "bfloat16", None)]
