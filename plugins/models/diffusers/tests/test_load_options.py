"""The load plan's options on the diffusers backend: quantization of "denoiser" finds the pipeline's transformer or
UNet, offload moves weights without changing values, and regional compile takes diffusers' ``_repeated_blocks``."""

from __future__ import annotations

import pytest
import torch

from omni_model_diffusers.parity import omni_fields
from omni_model_diffusers.testing import FAMILIES


def _run(path: str, name: str, **options):
    from omni_core import Omni

    with Omni(path, pipeline="diffusers", warmup=False, cpu_threads=1, **options) as omni:
        (out,) = omni.generate("a cat", seed=2, output_type="pt", use_tqdm=False,
                               **omni_fields(FAMILIES[name].call_kwargs))
        return out.images[0], omni.stats()["model_bytes"]


@pytest.mark.parametrize("name, denoiser", [("flux", "transformer"), ("sd", "unet")])
def test_int8_quantizes_the_denoiser_and_offload_is_exact(family, name, denoiser):
    path = family(name)
    plain, plain_bytes = _run(path, name)
    int8, int8_bytes = _run(path, name, quantization="int8")
    offloaded, _ = _run(path, name, offload="model")
    assert int8_bytes[denoiser] < 0.75 * plain_bytes[denoiser]  # Linear weights in int8 (the tiny UNet is half convs)
    assert int8_bytes["vae"] == plain_bytes["vae"]  # only the denoiser
    assert (int8 - plain).abs().max() < 0.05
    assert torch.equal(offloaded, plain)


def test_compile_takes_diffusers_repeated_blocks(family, monkeypatch):
    monkeypatch.setenv("OMNI_COMPILE_BACKEND", "eager")  # dynamo's graphs around the hooks, no kernel build
    from omni_core import Omni

    with Omni(family("flux"), pipeline="diffusers", warmup=False, cpu_threads=1, compile=True) as omni:
        (out,) = omni.generate("a cat", seed=2, output_type="pt", use_tqdm=False,
                               **omni_fields(FAMILIES["flux"].call_kwargs))
        region = omni.engine.executor.runner.pipeline.omni_compile
    plain, _ = _run(family("flux"), "flux")
    assert len(region.blocks) == 2 and not region.failed  # FLUX's double and single blocks
    assert (out.images[0] - plain).abs().max() < 5e-4


def test_omni_attention_backend_names_map_to_diffusers_dispatcher(family):
    """TORCH_SDPA is diffusers' "native" (the default: same pixels); FLASH_ATTN is "flash", which diffusers refuses
    here (no flash-attn on CPU) and Omni reports naming the option; per-role choices have no meaning there."""
    from omni_core.errors import OmniError

    plain, _ = _run(family("flux"), "flux")
    sdpa, _ = _run(family("flux"), "flux", attention_backend="TORCH_SDPA")
    assert torch.equal(sdpa, plain)
    with pytest.raises(OmniError) as err:
        _run(family("flux"), "flux", attention_backend="FLASH_ATTN")
    assert "'FLASH_ATTN' (diffusers' 'flash') cannot run transformer here" in str(err.value)
    with pytest.raises(OmniError) as err:
        _run(family("flux"), "flux", attention_config={"per_role": {"cross": "TORCH_SDPA"}})
    assert "per_role" in str(err.value)
