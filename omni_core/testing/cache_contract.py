"""``CacheBackendContract``: what every cache backend owes its users, as a pytest class to subclass.

    from omni_core.testing.cache_contract import CacheBackendContract

    class TestTeaCacheContract(CacheBackendContract):
        cache_backend = "tea_cache"
        cache_config = {"rel_l1_thresh": 0.2}      # a config that reuses work
        off_config = {"rel_l1_thresh": 0.0}        # a config that must change nothing

The model defaults to the tiny DiT of :mod:`omni_core.testing.tiny_dit` (fixture ``tiny_dit_model``), so a
cache plugin's own tests need no model plugin; set ``model`` or ``model_fixture`` to use another.

Checked, on the pipeline loaded through the real loader: the off config and a disabled backend are
bit-identical to no cache, and ``disable`` leaves every denoiser module with exactly the hooks (and the
``forward`` entry) it had before ``enable``; requests batched together and requests joining a step wave late each give exactly
what they give alone with the cache (a request's decisions are its own); the backend's metrics reach the
request's output through the engine. The suite skips when the backend is not installed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from omni_core.testing._model import contract_model, load_model
from omni_core.testing.driver import make_state, run_step_batch

__all__ = ["CacheBackendContract", "make_state", "run_step_batch"]


class CacheBackendContract:
    #: the cache backend's component name
    cache_backend: ClassVar[str] = ""
    #: a config under which the backend reuses work
    cache_config: ClassVar[dict[str, Any]] = {}
    #: a config under which it must reuse nothing (bit-identical to no cache); None: not offered
    off_config: ClassVar[dict[str, Any] | None] = None
    model: ClassVar[str | None] = None
    model_fixture: ClassVar[str | None] = "tiny_dit_model"
    #: sampling params of every run (enough steps that the cache has something to reuse)
    sampling: ClassVar[dict[str, Any]] = {"num_inference_steps": 6}
    prompts: ClassVar[tuple[str, ...] | None] = None
    #: metric keys the backend must add to a request's output (empty: any non-empty ``request_metrics``)
    metric_keys: ClassVar[tuple[str, ...]] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def backend_cls(cls) -> type:
        from omni_core.plugins import get_plugin_manager

        pm = get_plugin_manager()
        if not cls.cache_backend:
            raise pytest.UsageError(f"{cls.__name__}: set `cache_backend` to the backend's component name")
        if cls.cache_backend not in pm.components("cache"):
            pytest.skip(f"cache backend {cls.cache_backend!r} is not installed")
        return pm.load_component("cache", cls.cache_backend)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_path(cls, request: pytest.FixtureRequest, backend_cls: type) -> str:
        return contract_model(cls, request)

    @pytest.fixture
    def pipeline(self, contract_model_path: str) -> Any:
        """A freshly loaded pipeline per test (a backend's hooks never leak into the next check)."""
        return load_model(contract_model_path)

    def _states(self, pipeline: Any) -> list[Any]:
        prompts = list(self.prompts or type(pipeline).example_prompts())[:3]
        return [make_state(pipeline, p, seed=200 + i, **self.sampling) for i, p in enumerate(prompts)]

    def _run(self, pipeline: Any, backend: Any, admit_at: list[int] | None = None, only: int | None = None):
        states = self._states(pipeline)
        if only is not None:
            states = [states[only]]
        outs = run_step_batch(pipeline, states, admit_at, cache_backend=backend)
        return [o.tensor for o in outs], states

    @staticmethod
    def _equal(a: Any, b: Any, what: str) -> None:
        import torch

        assert torch.equal(a, b), f"{what}: not bit-identical (max diff {(a - b).abs().max().item():.3g})"

    def _all_equal(self, expected: list[Any], got: list[Any], what: str) -> None:
        for i, (a, b) in enumerate(zip(expected, got)):
            self._equal(a, b, f"prompt {i}: {what}")

    def _enabled(self, pipeline: Any, backend_cls: type, config: dict[str, Any] | None = None) -> Any:
        """A backend built from ``config`` (default: ``cache_config``), enabled on ``pipeline``."""
        backend = backend_cls(dict(self.cache_config if config is None else config))
        backend.enable(pipeline)
        return backend

    def test_off_config_is_bit_identical(self, pipeline: Any, backend_cls: type) -> None:
        if self.off_config is None:
            pytest.skip(f"{self.cache_backend} offers no config that reuses nothing")
        plain, _ = self._run(pipeline, None)
        cached, _ = self._run(pipeline, self._enabled(pipeline, backend_cls, self.off_config))
        self._all_equal(plain, cached, f"{self.cache_backend} with {self.off_config} vs no cache")

    @staticmethod
    def _hooks(pipeline: Any) -> dict[str, tuple[list[str], Any]]:
        """Every denoiser module's hook names and its own ``forward`` entry (None without one)."""
        from omni_core.hooks import hook_names
        from omni_core.pipelines.denoiser import denoisers_of

        return {f"{spec.name}:{name or '<denoiser>'}": (hook_names(m), vars(m).get("forward"))
                for spec in denoisers_of(pipeline) for name, m in spec.module.named_modules()}

    def test_disable_restores_the_model(self, pipeline: Any, backend_cls: type) -> None:
        plain, _ = self._run(pipeline, None)
        before = self._hooks(pipeline)
        backend = self._enabled(pipeline, backend_cls)
        self._run(pipeline, backend)
        backend.disable(pipeline)
        assert not backend.is_enabled()
        after = self._hooks(pipeline)
        changed = {name: (before.get(name), after.get(name)) for name in before.keys() | after.keys()
                   if before.get(name) != after.get(name)}
        assert not changed, (f"{self.cache_backend}.disable() left modules changed (hooks, forward) "
                             f"before -> after: {dict(sorted(changed.items())[:5])}")
        after, _ = self._run(pipeline, None)
        self._all_equal(plain, after, f"after {self.cache_backend}.disable() vs never enabled")

    def test_requests_are_independent_in_batches_and_step_waves(self, pipeline: Any, backend_cls: type) -> None:
        plain, _ = self._run(pipeline, None)
        backend = self._enabled(pipeline, backend_cls)
        alone = [self._run(pipeline, backend, only=i)[0][0] for i in range(3)]
        batched, _ = self._run(pipeline, backend)
        staggered, states = self._run(pipeline, backend, admit_at=[0, 1, 3])
        for i in range(3):
            self._equal(alone[i], batched[i], f"prompt {i} with {self.cache_backend}: alone vs batched")
            self._equal(alone[i], staggered[i], f"prompt {i} with {self.cache_backend}: alone vs joining a wave late")
        assert all(backend.request_metrics(s) for s in states), "request_metrics is empty after a cached run"
        assert any(not a.equal(b) for a, b in zip(alone, plain)), \
            f"{self.cache_backend} with {self.cache_config} reused nothing here, so independence was not tested"

    def test_metrics_reach_the_output(self, contract_model_path: str, backend_cls: type) -> None:
        from omni_core import Omni

        with Omni(contract_model_path, cache_backend=self.cache_backend, cache_config=dict(self.cache_config),
                  warmup=False) as omni:
            prompt = list(self.prompts or omni.engine.pipeline_cls.example_prompts())[0]
            (out,) = omni.generate(prompt, seed=1, use_tqdm=False, **self.sampling)
        assert out.status == "completed"
        wanted = set(self.metric_keys)
        if not wanted:
            pipeline = load_model(contract_model_path)
            backend = backend_cls(dict(self.cache_config))
            backend.enable(pipeline)
            _, states = self._run(pipeline, backend, only=0)
            wanted = set(backend.request_metrics(states[0]))
            assert wanted, f"{self.cache_backend}.request_metrics returned nothing"
        missing = sorted(wanted - set(out.metrics))
        assert not missing, f"metrics {missing} missing from the output's metrics {sorted(out.metrics)}"
