"""The dtype (and device) a layer runs in reach attention selection.

The CUDA platform prefers FLASH_ATTN, which takes only float16/bfloat16. With the platform's probes substituted
(a Hopper GPU, flash-attn installed), a float32 layer must get TORCH_SDPA and a bf16 one FLASH_ATTN: before,
the selector never received the dtype and the platform assumed bf16 for every layer.
"""

from __future__ import annotations

import pytest

cp = pytest.importorskip("omni_platform_cuda.platform")
fb = pytest.importorskip("omni_attention_flash.backend")

from omni_core.attention import Attention  # noqa: E402
from omni_core.attention.selector import select_attention_backend  # noqa: E402
from omni_core.config import OmniDiffusionConfig  # noqa: E402
from omni_core.errors import ComponentUnavailableError  # noqa: E402
from omni_core.forward_context import use_config  # noqa: E402

import torch  # noqa: E402


@pytest.fixture
def hopper(omni_plugin_manager, monkeypatch):
    """A machine with 2 sm90 GPUs and a working flash-attn, as far as the cuda platform and FLASH_ATTN can tell."""
    from omni_core.platforms import reset_current_platform

    monkeypatch.delenv("OMNI_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    monkeypatch.setattr(cp, "probe", lambda: cp.CudaProbe("2.8.0+cu128", "12.8", None, 2))
    monkeypatch.setattr(cp.CudaPlatform, "capability", lambda self, device=None: (9, 0))
    monkeypatch.setattr(fb.FlashAttentionBackend, "is_available", classmethod(lambda cls: (True, "")))
    if hasattr(fb.FlashAttentionBackend, "check_capability"):  # a kernel built for sm90 is installed
        monkeypatch.setattr(fb.FlashAttentionBackend, "check_capability", classmethod(lambda cls, cap: None))
    reset_current_platform()
    yield cp.CudaPlatform()
    reset_current_platform()


@pytest.mark.parametrize("dtype, expected", [
    ("float32", "TORCH_SDPA"),
    ("bfloat16", "FLASH_ATTN"),
    ("float16", "FLASH_ATTN"),
    ("auto", "FLASH_ATTN"),  # auto is the platform's default dtype: bfloat16 on CUDA
])
def test_layer_selects_for_the_config_dtype(hopper, dtype, expected):
    with use_config(OmniDiffusionConfig(model="m", platform="cuda", dtype=dtype)):
        layer = Attention(2, 64, role="self")
    assert layer.backend_name == expected
    assert layer.selection.source == "platform default (cuda)"


def test_explicit_layer_dtype_wins_over_the_config(hopper):
    with use_config(OmniDiffusionConfig(model="m", platform="cuda", dtype="bfloat16")):
        fp32 = Attention(2, 64, dtype=torch.float32)
        bf16 = Attention(2, 64)
    assert (fp32.backend_name, bf16.backend_name) == ("TORCH_SDPA", "FLASH_ATTN")


@pytest.mark.parametrize("dtype, expected", [(torch.float32, "TORCH_SDPA"), (torch.bfloat16, "FLASH_ATTN"),
                                             ("float32", "TORCH_SDPA"), (None, "FLASH_ATTN")])
def test_selector_passes_the_dtype_to_the_platform(hopper, dtype, expected):
    sel = select_attention_backend("self", head_size=64, dtype=dtype, device=torch.device("cuda", 0),
                                   platform=hopper)
    assert sel.name == expected and sel.source == "platform default (cuda)"


def test_explicit_backend_that_cannot_take_the_dtype_fails_when_built(hopper):
    """Chosen by the user, FLASH_ATTN is kept, but a float32 model is refused at load, not at the first forward."""
    config = OmniDiffusionConfig.from_kwargs(model="m", platform="cuda", dtype="float32",
                                             attention_backend="FLASH_ATTN")
    with use_config(config), pytest.raises(ComponentUnavailableError) as err:
        Attention(2, 64, role="cross")
    msg = str(err.value)
    assert "'FLASH_ATTN' (chosen by attention_config.default for role 'cross')" in msg
    assert "does not support dtype float32; supported: float16, bfloat16" in msg


def test_cpu_config_selects_for_the_cpu(omni_plugin_manager, monkeypatch):
    """The same model on the CPU platform: TORCH_SDPA, checked against float32 on device type cpu."""
    monkeypatch.delenv("OMNI_ATTENTION_BACKEND", raising=False)
    with use_config(OmniDiffusionConfig(model="m", platform="cpu")):
        layer = Attention(2, 64)
    assert (layer.backend_name, layer.selection.source) == ("TORCH_SDPA", "platform default (cpu)")
    assert (layer._dtype, layer._device) == ("float32", "cpu")
