"""The torch dtype a model runs in, from the config's ``dtype`` (``"auto"``: the platform's default).

A public home for what the executors, the workers and plugin tools (teacache's calibration) all need, so none
of them imports it from another's module. torch is imported on call only.
"""

from __future__ import annotations

from typing import Any

#: the config's dtype names -> torch attribute names
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def torch_dtype(config: Any, platform: Any) -> Any:
    """``config.dtype`` as a torch dtype; ``"auto"`` takes ``platform.default_dtype``."""
    import torch

    name = config.dtype if config.dtype != "auto" else platform.default_dtype
    return getattr(torch, DTYPES[name])


__all__ = ["DTYPES", "torch_dtype"]
