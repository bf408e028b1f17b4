import pytest

from omni_core import Omni
from omni_core.errors import ConfigError


def test_bad_key_is_refused_before_any_worker_starts(tiny_dit_model):
    with pytest.raises(ConfigError, match="'bogus'") as err:
        Omni(tiny_dit_model, cache_backend="every_other", cache_config={"bogus": 1}, executor="mp")
    assert err.value.field == "cache_config.bogus"


def test_metrics_count_every_other_step(tiny_dit_model):
    with Omni(tiny_dit_model, cache_backend="every_other", warmup=False) as omni:
        (out,) = omni.generate("a cat", seed=1, num_inference_steps=6, use_tqdm=False)
    assert out.metrics["steps_computed"] == out.metrics["steps_reused"]  # steps 0, 2, 4 computed; 1, 3, 5 reused
