"""cache_dit under Omni's sequence parallelism is refused at start-up (its decisions are not agreed across ranks)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("dit-qwen4h"), num_layers=2, num_heads=4)


def test_cache_dit_refuses_sequence_parallelism(qwen4_dir):
    from omni_core import Omni
    from omni_core.errors import OmniError

    with pytest.raises(OmniError, match="cache_dit cannot run with Omni's sequence parallelism"):
        Omni(qwen4_dir, dtype="float32", warmup=False, parallel_config={"ulysses_degree": 2},
             cache_backend="cache_dit")
