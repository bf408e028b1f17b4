"""``cache_backend="cache_dit"`` on the diffusers backend: cache-dit's own adapter for each family's pipeline reuses
steps, and the image stays within 30 dB PSNR of the uncached one (three DiT families, images and video)."""

from __future__ import annotations

import math

import pytest

from omni_model_diffusers.parity import omni_fields
from omni_model_diffusers.testing import FAMILIES

CACHE = {"residual_diff_threshold": 0.3, "max_warmup_steps": 4, "max_continuous_cached_steps": 2}


def psnr(a, b) -> float:
    mse = ((a.float() - b.float()) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


@pytest.mark.parametrize("name", ["flux", "pixart-sigma", "wan"])
def test_cache_dit_reuses_steps_within_30_db(family, name):
    pytest.importorskip("omni_cache_dit")
    from omni_core import Omni

    fields = {**omni_fields(FAMILIES[name].call_kwargs), "num_inference_steps": 20}
    outs = {}
    for backend in ("none", "cache_dit"):
        with Omni(family(name), pipeline="diffusers", warmup=False, cpu_threads=1, cache_backend=backend,
                  cache_config=CACHE if backend == "cache_dit" else {}) as omni:
            (outs[backend],) = omni.generate("a cat", seed=3, output_type="pt", use_tqdm=False, **fields)
    cached = outs["cache_dit"]
    assert cached.metrics["cache_backend"] == "cache_dit" and cached.metrics["steps_reused"] >= 5
    assert psnr(cached.images[0], outs["none"].images[0]) >= 30


def test_tea_cache_is_refused_naming_cache_dit(family):
    pytest.importorskip("omni_cache_teacache")
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError) as err:
        Omni(family("flux"), pipeline="diffusers", warmup=False, cpu_threads=1, cache_backend="tea_cache")
    assert "cache_dit" in str(err.value) and "declares no denoiser" in str(err.value)


def test_cache_dit_in_step_mode_is_refused_naming_it(family):
    """Step mode runs the modular blocks, never the pipeline's call that refreshes cache-dit's context: a second
    request would reuse the first one's residuals, so the pair is refused."""
    pytest.importorskip("omni_cache_dit")
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError) as err:
        Omni(family("flux"), pipeline="diffusers", warmup=False, cpu_threads=1, step_execution=True,
             cache_backend="cache_dit")
    assert "cache_backend='cache_dit' cannot run in step mode" in str(err.value)
