"""Ulysses-2 on the diffusers backend through diffusers' context parallelism (gloo, two worker processes): equal to
one process within 1e-5 on two transformers with a ``_cp_plan`` (FLUX.1, Wan); Ring on the CPU's attention kernel
and a folder whose denoiser has no plan (a UNet) are refused naming the degree."""

from __future__ import annotations

import pytest

from omni_model_diffusers.parity import omni_fields
from omni_model_diffusers.testing import FAMILIES

PROMPTS = ["a red fox jumping over a lazy dog", "a cat"]


def _run(folder: str, name: str, **options) -> list:
    from omni_core import Omni
    from omni_core.config import SamplingParams

    fields = omni_fields(FAMILIES[name].call_kwargs)
    params = [SamplingParams(seed=s, output_type="pt", **fields) for s in (3, 4)]
    with Omni(folder, pipeline="diffusers", warmup=False, cpu_threads=1, max_num_seqs=2, **options) as omni:
        outs = omni.generate(PROMPTS, sampling_params=params, use_tqdm=False)
    return outs


def _tensor(out):
    return out.images[0] if out.images else out.video


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_ulysses_2_equals_one_process(family, name):
    folder = family(name)
    one = _run(folder, name)
    two = _run(folder, name, executor="mp", parallel_config={"ulysses_degree": 2})
    for a, b in zip(one, two):
        a, b = _tensor(a), _tensor(b)
        assert a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= 1e-5
    # diffusers' own record of what it sharded, read back from the rank that answered
    assert two[0].metrics["ulysses_degree"] == 2 and two[0].metrics["cp_sharded_inputs"] >= 1
    assert "ulysses_degree" not in one[0].metrics


def test_a_unet_folder_is_refused_naming_the_degree(family):
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError) as err:
        Omni(family("sd"), pipeline="diffusers", warmup=False, executor="mp", parallel_config={"ulysses_degree": 2})
    assert "ulysses_degree" in str(err.value) and "_cp_plan" not in str(err.value) and "unet" in str(err.value)


def test_ring_on_the_native_kernel_is_refused_naming_it(family):
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError) as err:
        Omni(family("flux"), pipeline="diffusers", warmup=False, executor="mp", parallel_config={"ring_degree": 2})
    assert "ring_degree=2" in str(err.value) and "ulysses_degree" in str(err.value)
