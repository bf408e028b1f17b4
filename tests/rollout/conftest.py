"""The rollout tests' tiny folders (built once per session) and what each model is sampled with."""

from __future__ import annotations

import pytest

#: model -> (the SDE family its log-prob test samples with, its size fields); all four families covered
CASES = {"shapes": ("sde", dict(height=32, width=32)), "flux": ("cps", dict(height=32, width=32)),
         "wan": ("dance_sde", dict(height=32, width=32, num_frames=5)), "qwen": ("sde", dict(height=32, width=32))}


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    from omni_model_flux.testing import build_tiny_flux
    from omni_model_qwen_image.testing import build_tiny_qwen_image
    from omni_model_wan.testing import build_tiny_wan

    root = tmp_path_factory.mktemp("rollout")
    return {"shapes": "shapes", "flux": build_tiny_flux(root / "flux"), "wan": build_tiny_wan(root / "wan"),
            "qwen": build_tiny_qwen_image(root / "qwen")}


@pytest.fixture(params=list(CASES))
def case(request, folders):
    """``(model name, folder, sde type, size fields)`` for each model."""
    sde_type, size = CASES[request.param]
    return request.param, folders[request.param], sde_type, size
