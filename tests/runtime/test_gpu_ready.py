"""The engine's process never initialises CUDA, and outputs reach it as host tensors (issue #36).

No GPU here, so a throwaway platform plugin, ``fakecuda``, stands in: to the engine's process it is a CUDA platform
(device type ``cuda``, ``cuda:0``); in a worker (``RANK`` is set before a worker asks for its platform) it runs on
the CPU. In the engine's process ``torch.cuda._lazy_init`` -- which every path that creates a CUDA context goes
through, Python (``mem_get_info``, ``get_device_capability``) or C++ (a tensor made or moved to ``cuda``) -- is
replaced by one that records the call and raises, so a test sees any attempt, even one the code swallows.
"""

from __future__ import annotations

import os
import pickle
import textwrap
import traceback

import pytest
import torch

from omni_core.errors import ConfigError

STANDIN = '''
import os

from omni_core import hookimpl
from omni_core.platforms.cpu import CpuPlatform
from omni_core.platforms.cuda_like import CudaLikePlatform
from omni_core.plugins.types import PlatformSpec


def detect():
    return False, "a test stand-in, selected by name"


class FakeCudaPlatform(CudaLikePlatform):
    """CUDA to the engine's process; the CPU in a worker."""

    name = "fakecuda"

    def __init__(self):
        self.worker = "RANK" in os.environ
        if self.worker:
            self.device_type, self.dist_backend, self.default_dtype = "cpu", "gloo", "float32"

    def is_available(self):
        return True, ""

    def device_count(self):
        return 1

    def set_device(self, device):
        return CpuPlatform.set_device(self, device) if self.worker else super().set_device(device)

    def synchronize(self, device=None):
        return None if self.worker else super().synchronize(device)

    def empty_cache(self):
        return None if self.worker else super().empty_cache()

    def peak_memory_bytes(self, device=None):
        return 0 if self.worker else super().peak_memory_bytes(device)

    def memory_stats(self, device=None):
        return CpuPlatform.memory_stats(self, device) if self.worker else super().memory_stats(device)

    def default_attention_backend(self, head_size, dtype):
        return "TORCH_SDPA" if self.worker else super().default_attention_backend(head_size, dtype)


@hookimpl
def omni_register_platforms():
    return [PlatformSpec(name="fakecuda", impl="omni_test_fakecuda:FakeCudaPlatform",
                         detect="omni_test_fakecuda:detect")]
'''


@pytest.fixture
def fakecuda(tmp_path, monkeypatch):
    """Install the ``fakecuda`` platform plugin (on ``sys.path`` and ``PYTHONPATH``, so spawned workers see it)."""
    from omni_core.optimize.device_probe import device_facts
    from omni_core.optimize.quantize import method_status
    from omni_core.platforms import reset_current_platform
    from omni_core.plugins import reset_plugin_manager

    site = tmp_path / "site"
    site.mkdir()
    (site / "omni_test_fakecuda.py").write_text(STANDIN)
    info = site / "omni_test_fakecuda-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-test-fakecuda\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [omni_core.plugins]
        platform-fakecuda = omni_test_fakecuda
    """))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("OMNI_PLATFORM", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    reset_plugin_manager()
    reset_current_platform()
    method_status.cache_clear()
    device_facts.cache_clear()
    yield
    method_status.cache_clear()
    device_facts.cache_clear()
    reset_plugin_manager()
    reset_current_platform()


@pytest.fixture
def cuda_init_calls(monkeypatch):
    """Where this process tried to initialise CUDA (each attempt raises, as on a machine whose CUDA is broken)."""
    calls: list[str] = []

    def refuse() -> None:
        calls.append("".join(traceback.format_stack(limit=14)[:-1]))
        raise RuntimeError("test: CUDA initialised in the engine's process")

    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    return calls


def test_the_stand_in_catches_every_way_to_a_context(cuda_init_calls):
    """The check itself: each call the review found (and a plain tensor on cuda) goes through ``_lazy_init``."""
    for attempt in (lambda: torch.cuda.mem_get_info(0), torch.cuda.get_device_capability,
                    lambda: torch.nn.Linear(2, 2).to("cuda"), lambda: torch.zeros(1, device="cuda")):
        with pytest.raises(RuntimeError):
            attempt()
    assert len(cuda_init_calls) == 4


def test_mp_engine_process_never_initialises_cuda(fakecuda, cuda_init_calls):
    """Start, first output, close: the engine's process of an ``mp`` executor on a CUDA platform opens no context."""
    from omni_core import Omni

    with Omni("shapes", platform="fakecuda", executor="mp", warmup=False) as omni:
        assert omni.engine.executor.worker_pids() != [os.getpid()]
        (out,) = omni.generate("a red circle in the top left", num_inference_steps=1, seed=0, output_type="pt")
        assert out.status == "completed", out.error
        assert out.tensor.device.type == "cpu"
    assert not cuda_init_calls, "the engine's process initialised CUDA at:\n" + "\n---\n".join(cuda_init_calls)
    assert not torch.cuda.is_initialized()


def test_start_up_checks_ask_the_device_in_a_child_process(fakecuda, cuda_init_calls):
    """``performance_mode`` (free memory) and ``quantization`` (a kernel probe) still decide before any worker
    starts, with the reason, but the device is asked by a child process: none of it initialises CUDA here."""
    from omni_core import Omni
    from omni_core.optimize.presets import choose

    changes, report = choose(_config(performance_mode="memory"), _shapes_path(), torch.device("cuda", 0))
    assert report["device"] == "cuda" and report["free_bytes"] == 0  # no CUDA torch here: unknown
    assert "quantization" not in changes  # the child found int8 unusable on cuda: not chosen
    with pytest.raises(ConfigError) as err:
        Omni("shapes", platform="fakecuda", executor="mp", warmup=False, quantization="int8")
    assert err.value.field == "quantization"
    assert "quantization='int8' cannot run here" in str(err.value) and "cuda" in str(err.value)
    assert not cuda_init_calls, "the engine's process initialised CUDA at:\n" + "\n---\n".join(cuda_init_calls)


def _config(**kw):
    from omni_core.config import OmniDiffusionConfig

    return OmniDiffusionConfig(model="shapes", **kw)


def _shapes_path() -> str:
    from omni_core.pipelines.loader import resolve_model

    return resolve_model("shapes").model_path


# ------------------------------------------------------------------------------------------ host outputs
class OnDevice(torch.Tensor):
    """A CPU tensor that reports ``cuda:0``, as a decoded output left on the GPU does; any torch call on it
    (``.to``, ``.cpu``) returns a plain tensor, so moving it to the host is visible."""

    @property
    def device(self):  # noqa: D401 - shadows Tensor.device
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            return out.as_subclass(torch.Tensor) if isinstance(out, OnDevice) else out  # .to("cpu") of self


def _wave(size: int):
    from omni_core.outputs import DiffusionOutput
    from omni_core.waves import RunnerOutput

    image = torch.rand(1, 3, size, size)
    out = DiffusionOutput(request_id="r", tensor=image.as_subclass(OnDevice),
                          preview=torch.rand(3, 4, 4).as_subclass(OnDevice))
    return RunnerOutput(outputs={"r": out}), image


def _assert_host(result, image):
    out = result.outputs["r"]
    for value in (out.tensor, out.preview):
        assert type(value) is torch.Tensor and value.device.type == "cpu", (type(value), value.device)
    assert torch.equal(out.tensor, image)


@pytest.mark.parametrize("size", [8, 1024])  # by value, and through shared memory
def test_mp_transport_delivers_host_tensors(size):
    from omni_core.worker.transport import pack_outputs, unpack_outputs

    result, image = _wave(size)
    assert result.outputs["r"].tensor.device.type == "cuda"  # the stand-in works
    _assert_host(unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(result)))), image)


def test_ray_transport_delivers_host_tensors():
    pytest.importorskip("omni_executor_ray")
    from omni_executor_ray.transport import pack_for_ray, unpack_from_ray

    result, image = _wave(8)
    _assert_host(unpack_from_ray(pickle.loads(pickle.dumps(pack_for_ray(result)))), image)


def test_uni_executor_delivers_host_tensors(monkeypatch):
    from omni_core.executor.uni import UniProcExecutor

    result, image = _wave(8)
    ex = UniProcExecutor.__new__(UniProcExecutor)
    ex.runner = type("R", (), {"execute_step": lambda self, s: result, "execute_batch": lambda self, s: result})()
    _assert_host(ex.execute_step(None), image)


# ------------------------------------------------------------------------------------------ peak memory per request
class _PeakPlatform:
    """A platform whose allocator the stub pipeline drives: ``peak`` since the last reset, in bytes."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def hold(self, mib: int) -> None:
        self.peak = max(self.peak, self.current + mib * 2**20)

    def peak_memory_bytes(self, device=None) -> int:
        return self.peak

    def reset_peak_memory(self, device=None) -> None:
        self.peak = self.current


def _peak_runner(monkeypatch):
    import omni_core.platforms as platforms
    from omni_core.config import OmniDiffusionConfig
    from omni_core.outputs import DiffusionOutput
    from omni_core.pipelines.base import OmniPipeline
    from omni_core.worker.runner import ModelRunner

    platform = _PeakPlatform()
    monkeypatch.setattr(platforms, "platform_for", lambda config: platform)

    class Stub(OmniPipeline):
        """Each denoise step holds the MiB its prompt names (``"100"``) while it runs."""

        def __init__(self) -> None:
            pass

        def prepare_encode(self, state):
            state.num_steps = state.sampling_params.num_inference_steps
            return state

        def denoise_step(self, states):
            for s in states:
                platform.hold(int(s.request.prompt.split()[s.step_index % len(s.request.prompt.split())]))
            return [None] * len(states)

        def step_scheduler(self, state, pred):
            state.step_index += 1

        def post_decode(self, state):
            return DiffusionOutput(request_id=state.request_id, tensor=torch.zeros(1))

    runner = ModelRunner(OmniDiffusionConfig(model="shapes"), None, device=torch.device("cpu"), dtype=torch.float32)
    runner.pipeline = Stub()
    return runner


def _req(prompt: str, steps: int = 1):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    return OmniDiffusionRequest(prompt=prompt, sampling_params=SamplingParams(seed=0, num_inference_steps=steps))


def test_peak_memory_is_per_request_not_per_process(monkeypatch):
    """A small request after a large one reports its own peak (it was the process-lifetime peak, issue #36)."""
    from omni_core.waves import DiffusionSchedulerOutput

    runner = _peak_runner(monkeypatch)
    peaks = []
    for prompt in ("100", "10"):  # request path: one wave each
        r = _req(prompt)
        out = runner.execute_batch(DiffusionSchedulerOutput(new_requests=[r])).outputs[r.request_id]
        peaks.append(out.metrics["peak_memory_mb"])
    # step path: a request's peak is the highest of the waves it ran in, also when that was not its last wave
    big, small = _req("100 1", steps=2), _req("10", steps=1)
    runner.execute_step(DiffusionSchedulerOutput(new_requests=[big], scheduled_ids=[big.request_id]))
    outs = runner.execute_step(DiffusionSchedulerOutput(new_requests=[small],
                                                        scheduled_ids=[big.request_id, small.request_id])).outputs
    assert peaks == [100.0, 10.0]
    assert outs[big.request_id].metrics["peak_memory_mb"] == 100.0
    assert outs[small.request_id].metrics["peak_memory_mb"] == 10.0  # its one wave (big held 1 MiB there)
