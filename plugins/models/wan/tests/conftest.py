"""Session fixtures: tiny Wan 2.1, Wan 2.2 (two experts), I2V and TI2V folders, Omni's and diffusers' pipelines
from each (``wan21_dir``, ``omni_wan21``, ``diffusers_wan21``, ...; ``wan21`` etc. are the pair
``(diffusers, omni)``); torch at ``OMNI_TEST_THREADS`` (default 1) per test (``one_torch_thread``: on the
shared 2-core CI machine two OpenMP threads of tiny ops spin against the other jobs -- a tiny I2V generation:
0.44 s with 1 thread, 10.7 s with 2 at load average 7; an in-process engine sets its own count)."""

from __future__ import annotations

import functools
import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_wan.testing import build_tiny_wan, build_tiny_wan_i2v

os.environ.setdefault("HF_HUB_OFFLINE", "1")

wan21_dir, omni_wan21, diffusers_wan21 = tiny_model_fixtures("wan21", build_tiny_wan)
wan22_dir, omni_wan22, diffusers_wan22 = tiny_model_fixtures("wan22", functools.partial(build_tiny_wan,
                                                                                        two_experts=True))
#: Wan 2.1 I2V layout: CLIP image encoder + processor, one 36-channel transformer with ``image_dim``
i2v21_dir, omni_i2v21, diffusers_i2v21 = tiny_model_fixtures("i2v21", build_tiny_wan_i2v)
#: Wan 2.2 I2V-A14B layout: two 36-channel experts, ``boundary_ratio``, no image encoder
i2v22_dir, omni_i2v22, diffusers_i2v22 = tiny_model_fixtures("i2v22", functools.partial(build_tiny_wan_i2v,
                                                                                        wan22=True))
#: Wan 2.2 TI2V-5B layout: ``expand_timesteps`` (condition as the first latent frame, per-token timesteps)
ti2v_dir, omni_ti2v, diffusers_ti2v = tiny_model_fixtures("ti2v", functools.partial(build_tiny_wan_i2v,
                                                                                    expand_timesteps=True))


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Each test starts at ``OMNI_TEST_THREADS`` threads."""


def _pair_of(name: str):
    @pytest.fixture(scope="session", name=name)
    def pair(request):
        """(diffusers pipeline, Omni pipeline)."""
        return request.getfixturevalue(f"diffusers_{name}"), request.getfixturevalue(f"omni_{name}")
    return pair


wan21, wan22, i2v21, i2v22, ti2v = (_pair_of(n) for n in ("wan21", "wan22", "i2v21", "i2v22", "ti2v"))
