import os

import pytest

from omni_core import Omni
from omni_core.errors import ConfigError


def test_every_model_process_runs_on_the_chosen_cores(tiny_dit_model):
    with Omni(tiny_dit_model, executor="pinned", pinned_cpus="0", warmup=False) as omni:
        (out,) = omni.generate("a cat", height=32, width=32, num_inference_steps=2, seed=1)
        pids = [d["pid"] for d in omni.engine.collective_rpc("describe")]
        assert out.status == "completed" and os.getpid() not in pids
        assert [os.sched_getaffinity(pid) for pid in pids] == [{0}] * len(pids)


def test_a_bad_core_list_is_refused_naming_the_option(tiny_dit_model):
    with pytest.raises(ConfigError, match="pinned_cpus") as err:
        Omni(tiny_dit_model, executor="pinned", pinned_cpus="9999", warmup=False)
    assert "usable" in str(err.value)
