"""``PipelineContract``: the behaviour every Omni model plugin owes its users, as a pytest class to subclass.

    from omni_core.testing.pipeline_contract import PipelineContract

    class TestMyModelContract(PipelineContract):
        model = "my-model"                  # a folder or registered model name; or model_fixture = "<fixture>"
        sampling = {"num_inference_steps": 4, "height": 64, "width": 64}   # small and fast

Checked: the declared ``DenoiserSpec``s match the model (block signature, ``batch_args``, a per-row
``modulated_input``, every call inside ``use_denoise_call`` covering its rows); request mode and step mode give the same image for a seed; a request alone, in a batch and joining
a step wave late give the same image (within ``batch_atol``; 0 = bit-identical); an abort stops a running
request within a step; bad sampling params are refused before any work; streaming gives one preview per step;
a height/width that is not a multiple of ``size_multiple`` is refused with the field named.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest

from omni_core.testing._model import contract_model, load_model
from omni_core.testing.driver import make_state, run_step_batch

__all__ = ["PipelineContract", "make_state", "run_step_batch"]


def final_output(handle: Any, timeout: float = 300) -> Any:
    """The last (finished) output of an engine request handle."""
    return handle.result(timeout)


class PipelineContract:
    #: the model: a folder or a registered model name ...
    model: ClassVar[str | None] = None
    #: ... or the name of a fixture returning a model folder
    model_fixture: ClassVar[str | None] = None
    #: sampling params of every run (keep them small: steps, size)
    sampling: ClassVar[dict[str, Any]] = {}
    #: prompts to use (default: the pipeline's ``example_prompts()``)
    prompts: ClassVar[tuple[str, ...] | None] = None
    #: largest allowed difference between a request alone and the same request batched (0: bit-identical)
    batch_atol: ClassVar[float] = 0.0
    #: steps of the request aborted mid-run (long enough that the abort lands while it runs)
    abort_steps: ClassVar[int] = 30
    #: ``Omni(...)`` keyword arguments of every engine the suite starts
    engine_kwargs: ClassVar[dict[str, Any]] = {"warmup": False}

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_path(cls, request: pytest.FixtureRequest) -> str:
        return contract_model(cls, request)

    @pytest.fixture(scope="class")
    @classmethod
    def contract_pipeline(cls, contract_model_path: str) -> Any:
        return load_model(contract_model_path)

    def _prompts(self, pipeline_cls: type) -> list[str]:
        prompts = list(self.prompts or pipeline_cls.example_prompts())
        assert len(prompts) >= 3, "the contract needs at least 3 prompts (set `prompts` or example_prompts())"
        return prompts[:3]

    def _omni(self, model: str, **kwargs: Any) -> Any:
        from omni_core import Omni

        return Omni(model, **{**self.engine_kwargs, **kwargs})

    def _same(self, a: Any, b: Any, what: str) -> None:
        import torch

        assert a.shape == b.shape, f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}"
        if self.batch_atol == 0:
            assert torch.equal(a, b), f"{what}: not bit-identical (max diff {(a - b).abs().max().item():.3g})"
        else:
            torch.testing.assert_close(a, b, atol=self.batch_atol, rtol=0, msg=lambda m: f"{what}: {m}")

    # ------------------------------------------------------------------ checks
    def test_request_mode_equals_step_mode(self, contract_model_path: str) -> None:
        prompt = self._prompts(load_model_cls(contract_model_path))[0]
        images = []
        for step_execution in (False, True):
            with self._omni(contract_model_path, step_execution=step_execution) as omni:
                (out,) = omni.generate(prompt, seed=7, output_type="pt", use_tqdm=False, **self.sampling)
            assert out.status == "completed"
            images.append(out.images[0])
        self._same(images[0], images[1], "request mode vs step mode, same seed")

    def test_alone_equals_batched_equals_staggered(self, contract_pipeline: Any) -> None:
        p = contract_pipeline
        prompts = self._prompts(type(p))

        def states():
            return [make_state(p, prompt, seed=100 + i, **self.sampling) for i, prompt in enumerate(prompts)]

        alone = [run_step_batch(p, [s])[0].tensor for s in states()]
        batched = [o.tensor for o in p.forward(states())]
        staggered = [o.tensor for o in run_step_batch(p, states(), admit_at=[0, 1, 3])]
        for i, (a, b, c) in enumerate(zip(alone, batched, staggered)):
            self._same(a, b, f"prompt {i}: alone vs in a request batch")
            self._same(a, c, f"prompt {i}: alone vs joining a step wave late")
        assert not any(alone[0].equal(x) for x in alone[1:]), "different prompts and seeds gave the same image"

    def test_denoiser_specs_match_the_model(self, contract_pipeline: Any) -> None:
        import inspect

        from omni_core.forward_context import forward_context
        from omni_core.pipelines.denoiser import denoisers_of

        p = contract_pipeline
        specs = denoisers_of(p)
        seen: dict[str, list] = {spec.name: [] for spec in specs}
        hooks = []
        for spec in specs:
            spec.check_block_signature("PipelineContract")
            params = set(inspect.signature(spec.module.forward).parameters)
            assert set(spec.batch_args) <= params, f"{spec.name}: batch_args {spec.batch_args} not all in {params}"

            def on_block0(module, args, kwargs, spec=spec):
                bound = dict(zip(spec.block_params, args))
                bound.update({k: v for k, v in kwargs.items() if k in spec.block_params})
                seen[spec.name].append((forward_context().call, bound))

            hooks.append(spec.blocks[0].register_forward_pre_hook(on_block0, with_kwargs=True))
        try:
            run_step_batch(p, [make_state(p, prompt, seed=i, **{**self.sampling, "num_inference_steps": 2})
                               for i, prompt in enumerate(self._prompts(type(p))[:2])])
        finally:
            for h in hooks:
                h.remove()
        assert any(seen.values()), "no declared denoiser's blocks ran"
        for spec in specs:
            for call, bound in seen[spec.name]:
                batch = bound[spec.residual_stream].shape[0]
                assert call is not None and call.covers(batch), \
                    f"{spec.name} ran outside use_denoise_call(...) or its groups do not cover its {batch} rows"
                if spec.modulated_input is not None:
                    signal = spec.modulated_input(spec.module, spec.blocks[0], bound)
                    assert signal.shape[0] == batch, f"{spec.name}: modulated_input must give one row per batch row"

    @pytest.mark.parametrize("step_execution", [False, True], ids=["request-mode", "step-mode"])
    def test_abort_stops_a_running_request_within_a_step(self, contract_model_path: str,
                                                          step_execution: bool) -> None:
        from omni_core.config import SamplingParams
        from omni_core.request import OmniDiffusionRequest

        with self._omni(contract_model_path, step_execution=step_execution) as omni:
            params = SamplingParams(**{**self.sampling, "num_inference_steps": self.abort_steps, "seed": 1})
            req = OmniDiffusionRequest(prompt=self._prompts(omni.engine.pipeline_cls)[0], sampling_params=params)
            aborted_at: list[int] = []
            done = threading.Event()

            def on_step(rid: str, step: int, total: int) -> None:
                if step >= 2 and not aborted_at:
                    aborted_at.append(step)
                    omni.engine.abort(rid)
                    done.set()

            (stream,) = omni.engine.submit([req], on_progress=on_step)
            out = final_output(stream)
            assert done.is_set(), f"the request finished ({out.status}) before 2 steps were reported"
            assert out.status == "aborted"
            assert out.metrics["steps_run"] <= aborted_at[0] + 1 < self.abort_steps
            assert omni.stats()["tracked_requests"] == []

    def test_bad_sampling_params_are_refused_before_any_work(self, contract_model_path: str) -> None:
        from omni_core.errors import ConfigError

        with self._omni(contract_model_path) as omni:
            cls = omni.engine.pipeline_cls
            limits = omni.engine.limits
            too_many = (limits.max_steps or 10_000) + 1
            with pytest.raises(ConfigError) as err:
                omni.generate(self._prompts(cls)[0], use_tqdm=False, **{**self.sampling,
                                                                         "num_inference_steps": too_many})
            assert err.value.field == "num_inference_steps" and str(too_many) in str(err.value)
            if limits.max_prompt_chars is not None:  # one bad request refuses the whole call: nothing runs
                long_prompt = "a " * (limits.max_prompt_chars // 2 + 1)
                with pytest.raises(ConfigError) as err:
                    omni.generate([self._prompts(cls)[0], long_prompt], use_tqdm=False, **self.sampling)
                assert err.value.field == "prompt"
            assert omni.stats()["tracked_requests"] == []

    def test_streaming_gives_one_preview_per_step(self, contract_model_path: str) -> None:
        from omni_core.config import SamplingParams
        from omni_core.request import OmniDiffusionRequest

        steps = 3
        with self._omni(contract_model_path, streaming_output=True) as omni:
            params = SamplingParams(**{**self.sampling, "num_inference_steps": steps, "seed": 3})
            req = OmniDiffusionRequest(prompt=self._prompts(omni.engine.pipeline_cls)[0], sampling_params=params)
            (stream,) = omni.engine.submit([req])
            outs = [stream.get(timeout=300)]
            while not outs[-1].finished:
                outs.append(stream.get(timeout=300))
        assert [o.finished for o in outs] == [False] * steps + [True]
        assert [o.step_index for o in outs[:-1]] == list(range(1, steps + 1))
        for o in outs[:-1]:
            assert o.preview is not None and o.preview.dim() == 3 and o.preview.shape[0] == 3, \
                f"step {o.step_index}: a preview is an RGB [3, h, w] tensor"
            assert 0 <= float(o.preview.min()) and float(o.preview.max()) <= 1
        assert outs[-1].status == "completed" and outs[-1].images

    @pytest.mark.parametrize("field", ["height", "width"])
    def test_size_not_a_multiple_is_refused_naming_the_field(self, contract_model_path: str, field: str) -> None:
        from omni_core.config import SamplingParams
        from omni_core.errors import ConfigError

        cls = load_model_cls(contract_model_path)
        m = cls.size_multiple
        if m <= 1:
            pytest.skip(f"{cls.__name__} accepts any size (size_multiple={m})")
        base = cls.check_sampling_params(SamplingParams(**self.sampling))
        bad = getattr(base, field) + m // 2 if m % 2 == 0 else getattr(base, field) + 1
        with pytest.raises(ConfigError, match=f"multiple of {m}") as err:
            cls.check_sampling_params(base.replace(**{field: bad}))
        assert err.value.field == field and str(bad) in str(err.value)


def load_model_cls(model: str) -> type:
    """The pipeline class behind ``model`` (resolved, not loaded)."""
    from omni_core.pipelines import resolve_model

    return resolve_model(model).pipeline_cls()
