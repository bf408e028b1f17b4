"""cache_dit under Omni's sequence parallelism is refused at start-up, naming why (its skip decisions are not agreed
across ranks), on the core's tiny DiT: two gloo processes, only this plugin installed."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist


def test_cache_dit_refuses_sequence_parallelism(tiny_dit_model):
    from omni_core import Omni
    from omni_core.errors import OmniError

    # refused by the core's table of combinations (omni_core/combinations.py), before any worker starts
    with pytest.raises(OmniError, match=r"cache_backend='cache_dit' cannot be combined with "
                                        r"parallel_config\.ulysses_degree > 1"):
        Omni(tiny_dit_model, warmup=False, parallel_config={"ulysses_degree": 2}, cache_backend="cache_dit")
