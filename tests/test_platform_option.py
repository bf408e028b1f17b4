"""``OmniDiffusionConfig.platform`` is honoured (engine, uni and mp workers) and the world size must fit it.

A throwaway platform plugin, ``spy``, is installed for these tests as a real distribution (``.dist-info`` with
an entry point on ``sys.path``, inherited by spawned workers). It is a CPU platform that records, per process,
that a worker set it up, so a test can see which platform each worker really used.
"""

from __future__ import annotations

import multiprocessing
import os
import textwrap
import time

import pytest

from omni_core.config import OmniDiffusionConfig
from omni_core.errors import ComponentUnavailableError, ConfigError
from omni_core.platforms import Platform, check_world_size, reset_current_platform

SPY = '''
import os
from omni_core import hookimpl
from omni_core.platforms.cpu import CpuPlatform
from omni_core.plugins.types import PlatformSpec


def detect():
    return os.environ.get("OMNI_SPY_DETECTED") == "1", "OMNI_SPY_DETECTED"


class SpyPlatform(CpuPlatform):
    name = "spy"

    def set_device(self, device):
        with open(os.path.join(os.environ["OMNI_SPY_DIR"], str(os.getpid())), "w") as f:
            f.write(str(device))


@hookimpl
def omni_register_platforms():
    return [PlatformSpec(name="spy", impl="omni_test_spy:SpyPlatform", detect="omni_test_spy:detect")]
'''


@pytest.fixture
def spy(tmp_path, monkeypatch):
    """Install the ``spy`` platform plugin; yields the folder where workers that used it leave their PIDs."""
    from omni_core.plugins import reset_plugin_manager

    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "omni_test_spy.py").write_text(SPY)
    info = site / "omni_test_spy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-test-spy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [omni_core.plugins]
        platform-spy = omni_test_spy
    """))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMNI_SPY_DIR", str(marks))
    monkeypatch.delenv("OMNI_SPY_DETECTED", raising=False)
    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    reset_plugin_manager()
    reset_current_platform()
    yield marks
    reset_plugin_manager()
    reset_current_platform()


def generate_once(**config):
    from omni_core import Omni

    with Omni("shapes", warmup=False, **config) as omni:
        (out,) = omni.generate("a red circle in the top left", num_inference_steps=1, seed=0, output_type="pt")
        pids = omni.engine.executor.worker_pids() if hasattr(omni.engine.executor, "worker_pids") else [os.getpid()]
    assert out.status == "completed", out.error
    return pids


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_configured_platform_reaches_the_workers(spy, executor):
    """``spy`` is not detected here, so only the config can make the workers use it."""
    pids = generate_once(platform="spy", executor=executor)
    assert sorted(int(p) for p in os.listdir(spy)) == sorted(pids)


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_platform_cpu_wins_over_a_detected_platform(spy, monkeypatch, executor):
    monkeypatch.setenv("OMNI_SPY_DETECTED", "1")  # detection (and so current_platform) now says spy
    from omni_core.platforms import current_resolution

    assert current_resolution().name == "spy"
    generate_once(platform="cpu", executor=executor)
    assert os.listdir(spy) == [], "a worker set up the detected platform although the config says cpu"
    generate_once(executor="uni")  # without the option detection decides: the check above can fail
    assert os.listdir(spy) == [str(os.getpid())]


def test_unusable_platform_fails_at_start_with_its_reason():
    cuda = pytest.importorskip("omni_platform_cuda.platform")
    ok, why = cuda.detect()
    if ok:
        pytest.skip(f"a CUDA device is here: {why}")
    from omni_core import Omni

    before = set(multiprocessing.active_children())
    with pytest.raises(ComponentUnavailableError) as err:
        Omni("shapes", platform="cuda", warmup=False)
    assert f"platform 'cuda' was requested but cannot run here: {why}" in str(err.value)
    assert set(multiprocessing.active_children()) == before


# ------------------------------------------------------------------------------------------ world size
def test_cpu_capacity_is_the_usable_cores():
    from omni_core.platforms.cpu import CpuPlatform

    n, what = CpuPlatform().max_world_size()
    assert n == len(os.sched_getaffinity(0)) and what == f"{n} usable CPU core(s)"


def test_too_many_ranks_are_refused_before_any_worker_starts():
    from omni_core import Omni

    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        Omni("shapes", parallel_config={"data_parallel_size": 64}, warmup=False)
    assert time.monotonic() - start < 30
    assert set(multiprocessing.active_children()) == before, "workers were started"
    cores = len(os.sched_getaffinity(0))
    assert err.value.field == "parallel_config"
    assert (f"parallel_config needs dp 64 = 64 process(es) but platform 'cpu' can place {cores} ({cores} usable "
            f"CPU core(s)); lower the degrees to a product of at most {cores}, or pass oversubscribe=True "
            f"(omni serve --oversubscribe)") in str(err.value)


class FourGpus(Platform):
    name = "fake"

    def device_count(self):
        return 4


@pytest.mark.parametrize("parallel, oversubscribe, ok", [
    ({"ulysses_degree": 2, "ring_degree": 2}, False, True),
    ({"ulysses_degree": 2, "cfg_parallel_size": 2, "data_parallel_size": 2}, False, False),
    ({"ulysses_degree": 2, "cfg_parallel_size": 2, "data_parallel_size": 2}, True, True),
    ({"data_parallel_size": 5}, False, False),
])
def test_world_size_against_the_device_count(parallel, oversubscribe, ok):
    config = OmniDiffusionConfig(model="m", parallel_config=parallel, oversubscribe=oversubscribe)
    if ok:
        check_world_size(config, FourGpus())
        return
    with pytest.raises(ConfigError, match=r"platform 'fake' can place 4 \(4 fake device\(s\)\)") as err:
        check_world_size(config, FourGpus())
    assert err.value.field == "parallel_config"


def test_oversubscribe_must_be_a_bool():
    with pytest.raises(ConfigError, match="oversubscribe='yes' is invalid: expected True or False"):
        OmniDiffusionConfig(model="m", oversubscribe="yes")
