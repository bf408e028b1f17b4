"""How a contract suite finds its model: a name/folder attribute, or a fixture that returns a folder."""

from __future__ import annotations

from typing import Any

import pytest


def contract_model(owner: Any, request: pytest.FixtureRequest) -> str:
    """``owner.model`` (a folder or registered name), else the value of the fixture ``owner.model_fixture``."""
    if getattr(owner, "model", None):
        return owner.model
    name = getattr(owner, "model_fixture", None)
    if not name:
        raise pytest.UsageError(f"{type(owner).__name__}: set `model` (a folder or model name) or `model_fixture` "
                                f"(a fixture returning a folder)")
    return request.getfixturevalue(name)


def load_model(model: str, **config: Any) -> Any:
    """The pipeline loaded through the real resolver and loader (CPU, float32), as a worker loads it; ``config``:
    more ``OmniDiffusionConfig`` fields (e.g. ``attention_config``)."""
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    resolved = resolve_model(model)
    return load_pipeline(resolved, OmniDiffusionConfig(model=model, dtype="float32", **config), "cpu", torch.float32)
