"""The ray executor on GPUs (issue #36): under NCCL every rank needs a whole GPU of its own (a fractional or zero
``ray_gpus_per_rank``, or an ``oversubscribe`` the cluster cannot hold, is a ConfigError naming the field and what
is allowed, before any actor starts), and the actors see the ``NCCL_*`` / ``TORCH_NCCL_*`` / ``CUDA_*`` variables
set where the engine runs (``CUDA_VISIBLE_DEVICES`` excepted: Ray sets it per actor): which ones, here; that they
reach the actors needs the Ray cluster, so that check runs with the cluster's tests, on an engine it shares
(``test_ray_executor.py::TestDataParallelEngine::test_actors_see_the_nccl_variables_of_the_engine``)."""

from __future__ import annotations

import types

import pytest

from omni_core.config import OmniDiffusionConfig
from omni_core.errors import ConfigError

NCCL = types.SimpleNamespace(name="cuda", device_type="cuda", dist_backend="nccl")
GLOO = types.SimpleNamespace(name="cpu", device_type="cpu", dist_backend="gloo")


@pytest.mark.parametrize("gpus", [0.5, 0.25, 1.5, 0.0])
def test_fractional_or_no_gpu_per_rank_is_refused_under_nccl(monkeypatch, gpus):
    import omni_core.platforms as platforms

    from omni_executor_ray.executor import RayExecutor

    config = OmniDiffusionConfig.from_kwargs(model="shapes", executor="ray", ray_gpus_per_rank=gpus,
                                             ray_address="127.0.0.1:1")  # nothing listens there: never reached
    monkeypatch.setattr(platforms, "platform_for", lambda config: NCCL)
    with pytest.raises(ConfigError, match=r"allowed with its nccl backend: a whole number >= 1") as info:
        RayExecutor(config, None).start()
    assert info.value.field == "ray_gpus_per_rank"
    assert f"ray_gpus_per_rank={gpus:g}" in str(info.value)


def test_whole_gpus_under_nccl_and_any_share_on_cpu_are_accepted():
    from omni_executor_ray.executor import check_gpu_placement

    config = OmniDiffusionConfig(model="shapes")
    for gpus in (None, 1.0, 2.0):
        check_gpu_placement({"gpus_per_rank": gpus}, config, NCCL)
    for gpus in (0.0, 0.5):
        check_gpu_placement({"gpus_per_rank": gpus}, config, GLOO)


def test_oversubscribe_beyond_the_clusters_gpus_is_refused_under_nccl():
    from omni_executor_ray.executor import check_cluster_gpus

    over = OmniDiffusionConfig(model="shapes", parallel_config={"ulysses_degree": 2}, oversubscribe=True)
    with pytest.raises(ConfigError, match=r"the Ray cluster has 1 GPU\(s\); under NCCL ranks cannot share a GPU, so "
                                          r"oversubscribe=True cannot apply here: allowed a world size of at most 1"
                       ) as info:
        check_cluster_gpus(over, NCCL, 1.0, cluster_gpus=1.0)
    assert info.value.field == "oversubscribe"
    check_cluster_gpus(over, NCCL, 1.0, cluster_gpus=2.0)  # multi-node: the cluster holds it
    check_cluster_gpus(over, GLOO, 0.0, cluster_gpus=0.0)  # CPU ranks share cores freely
    plain = OmniDiffusionConfig(model="shapes", parallel_config={"ulysses_degree": 2})
    with pytest.raises(ConfigError) as info:
        check_cluster_gpus(plain, NCCL, 1.0, cluster_gpus=1.0)
    assert info.value.field == "parallel_config"


def test_forwarded_variables():
    from omni_executor_ray.executor import forwarded_env

    env = {"NCCL_SOCKET_IFNAME": "eth1", "TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "CUDA_VISIBLE_DEVICES": "3", "CUDA_HOME": "/usr/local/cuda", "OMNI_X": "1", "PATH": "/bin"}
    assert forwarded_env(env) == {"NCCL_SOCKET_IFNAME": "eth1", "TORCH_NCCL_BLOCKING_WAIT": "1",
                                  "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMNI_X": "1"}
