"""``PipelineContract``: the behaviour every Omni model plugin owes its users, as a pytest class to subclass.

    from omni_core.testing.pipeline_contract import PipelineContract

    class TestMyModelContract(PipelineContract):
        model = "my-model"                  # a folder or registered model name; or model_fixture = "<fixture>"
        sampling = {"num_inference_steps": 4, "height": 64, "width": 64}   # small and fast

Checked: the declared ``DenoiserSpec``s match the model (block signature, ``batch_args``, ``num_heads``, the SP
plan's module paths, a per-row ``modulated_input``, every call inside ``use_denoise_call`` covering its rows);
request mode and step mode give the same image for a seed; a request alone, in a batch and joining a step wave
late give the same image (within ``batch_atol``; 0 = bit-identical); an abort stops a running request within a
step; bad sampling params are refused before any work; streaming gives one preview per step; a height/width that
is not a multiple of ``size_multiple`` is refused with the field named; the model is registered by the
distribution that ships it.

What the model declares is what the engine uses: the ``sampling_fields`` on its ``PipelineSpec`` record are its
class's, fields declared ``splits_batch`` split waves (and others do not), a field another installed model
declares is refused naming the field and this pipeline; every attention module of every declared denoiser runs
an Omni processor through an ``OmniAttention`` layer chosen by its role (``per_role`` by role and by role
category), one call per layer and step for a batch of requests; the preview and the output of a non-square
request keep its aspect ratio.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest

from omni_core.testing._model import contract_model, load_model
from omni_core.testing.contract_helpers import (_two_values, final_output, load_model_cls, omni_layers,  # noqa: F401
                                               torch_equal)
from omni_core.testing.driver import make_state, run_step_batch

__all__ = ["PipelineContract", "make_state", "run_step_batch"]


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
    #: the fixture of a folder on which every declared sampling field is valid, where the contract's model is not
    #: one (e.g. a second-expert guidance scale only a two-expert folder takes); default: the contract's model
    fields_model_fixture: ClassVar[str | None] = None
    #: ``Omni(...)`` keyword arguments of every engine the suite starts
    engine_kwargs: ClassVar[dict[str, Any]] = {"warmup": False}
    #: check the stages the model declares in processes of their own (``encode_workers`` / ``decode_workers``);
    #: a plugin whose own tests cover them may turn it off to save the two engine starts
    stages_check: ClassVar[bool] = True

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

    def test_stages_apart_equal_in_line(self, contract_model_path: str) -> None:
        """The stages the model declares (``stage_components``), each in a process of its own, give the in-line
        pipeline's images bit for bit (one torch thread per process: the same sums), and the model process then
        holds none of their components."""
        from omni_core.pipelines import resolve_model
        from omni_core.pipelines.text_window import declares_text_keys
        from omni_core.pipelines.stages import DENOISE, STAGES, declared_stages

        resolved = resolve_model(contract_model_path)
        cls = resolved.pipeline_cls()
        declared = declared_stages(cls, resolved.model_path)
        stages = {f"{s}_workers": 1 for s in STAGES if s in declared and (s != "encode" or declares_text_keys(cls))}
        if not self.stages_check or not stages:
            pytest.skip("no stage to run apart (stage_components / text_keys), or stages_check is off")
        prompts = self._prompts(cls)[:2]
        runs = []
        for kwargs in ({}, stages):
            with self._omni(contract_model_path, step_execution=True, cpu_threads=1, **kwargs) as omni:
                outs = omni.generate(prompts, seed=11, output_type="pt", use_tqdm=False, **self.sampling)
                runs.append((outs, omni.engine.stats()))
        (inline, _), (split, stats) = runs
        apart = {n for s in stages for n in declared[s.removesuffix("_workers")]} - set(declared.get(DENOISE, ()))
        assert not apart & set(stats["model_bytes"]), f"the model process still holds {apart & set(stats['model_bytes'])}"
        for i, (a, b) in enumerate(zip(inline, split)):
            assert b.status == "completed", b.error
            assert torch_equal(a.images[0], b.images[0]), f"prompt {i}: {sorted(stages)} differ from in line"

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

        from omni_core.attention import Attention

        p = contract_pipeline
        specs = denoisers_of(p)
        seen: dict[str, list] = {spec.name: [] for spec in specs}
        hooks = []
        for spec in specs:
            spec.check_block_signature("PipelineContract")
            params = set(inspect.signature(spec.module.forward).parameters)
            assert set(spec.batch_args) <= params, f"{spec.name}: batch_args {spec.batch_args} not all in {params}"
            heads = {m.num_heads for m in spec.module.modules() if isinstance(m, Attention)}
            assert spec.num_heads is None or heads <= {spec.num_heads}, \
                f"{spec.name}: declares num_heads={spec.num_heads}, its attention layers have {sorted(heads)}"
            if spec.sp_plan is not None:  # the plan installs (every module and argument it names exists)
                from omni_core.attention.parallel import apply_sequence_parallel

                apply_sequence_parallel(spec.module, spec.sp_plan).remove()

            def on_block0(module, args, kwargs, spec=spec):
                bound = dict(zip(spec.block_params, args))
                bound.update({k: v for k, v in kwargs.items() if k in spec.block_params})
                seen[spec.name].append((forward_context().call, bound))

            hooks.append(spec.blocks[0].register_forward_pre_hook(on_block0, with_kwargs=True))
        try:
            # the second request asks for two outputs: a signal has one row per image of the call
            run_step_batch(p, [make_state(p, prompt, seed=i, num_outputs_per_prompt=i + 1,
                                          **{**self.sampling, "num_inference_steps": 2})
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

    # ------------------------------------------------------------------ declarations
    def test_registered_by_the_distribution_that_ships_it(self, contract_model_path: str) -> None:
        """The folder resolves to the pipeline through an ``omni_core.plugins`` entry point of the distribution
        that ships the pipeline's package (not a copy registered by some other plugin)."""
        import importlib.metadata

        from omni_core.pipelines import resolve_model
        from omni_core.plugins.manager import ENTRY_POINT_GROUP

        resolved = resolve_model(contract_model_path)
        package = resolved.spec.impl.split(":")[0].split(".")[0]
        entry_points = [ep for ep in importlib.metadata.distribution(resolved.spec.provider).entry_points
                        if ep.group == ENTRY_POINT_GROUP]
        assert any(ep.value.split(":")[0].split(".")[0] == package for ep in entry_points), \
            f"{resolved.spec.name} ({resolved.spec.impl}) is registered by {resolved.spec.provider}, whose entry " \
            f"points are {[ep.value for ep in entry_points]}"

    def test_sampling_fields_are_declared_once_and_key_batches(self, contract_model_path: str,
                                                               request: pytest.FixtureRequest) -> None:
        from omni_core.config import SamplingParams
        from omni_core.pipelines import resolve_model
        from omni_core.request import OmniDiffusionRequest
        from omni_core.sched import RequestScheduler, StepScheduler

        folder = request.getfixturevalue(self.fields_model_fixture) if self.fields_model_fixture \
            else contract_model_path
        resolved = resolve_model(folder)
        cls, record = resolved.pipeline_cls(), resolved.spec
        assert tuple(record.sampling_fields) == tuple(cls.sampling_fields), \
            f"{cls.__name__}: the PipelineSpec record's sampling_fields differ from the class's"

        def req(**fields: Any) -> OmniDiffusionRequest:
            params = cls.check_sampling_params(SamplingParams(**{**self.sampling, **fields}), folder)
            return OmniDiffusionRequest(prompt="p", sampling_params=params)

        for field in cls.sampling_fields:
            assert getattr(req().sampling_params, field.name) == field.default, \
                f"{field.name}: an unset field must take the declared default {field.default!r}"
            one, other = _two_values(field)
            for sched in (RequestScheduler(), StepScheduler()):
                key = sched.batch_key
                assert key(req(**{field.name: one})) == key(req(**{field.name: one}))
                split = key(req(**{field.name: one})) != key(req(**{field.name: other}))
                assert split == field.splits_batch, \
                    f"{field.name}={one!r} and {other!r} {'share' if not split else 'split'} a wave, but the field " \
                    f"declares splits_batch={field.splits_batch}"
                if field.default is not None:
                    assert key(req()) == key(req(**{field.name: field.default}))

    def test_fields_of_other_models_are_refused_naming_the_field(self, contract_model_path: str) -> None:
        from omni_core.config import SamplingParams, registered_sampling_fields
        from omni_core.errors import ConfigError

        cls = load_model_cls(contract_model_path)
        own = {f.name for f in cls.sampling_fields}
        foreign = {name: owners[0][1] for name, owners in registered_sampling_fields().items() if name not in own}
        if not foreign:
            pytest.skip(f"no installed model declares a sampling field {cls.__name__} does not")
        for name, field in foreign.items():
            with pytest.raises(ConfigError) as err:
                cls.check_sampling_params(SamplingParams(**{**self.sampling, name: _two_values(field)[1]}),
                                          contract_model_path)
            assert err.value.field == name
            assert f"{name} is not used by {cls.__name__}" in str(err.value)
            if cls.undeclared_field_hint:
                assert str(err.value).endswith(cls.undeclared_field_hint)

    def test_attention_runs_through_omni_layers_chosen_by_role(self, contract_model_path: str) -> None:
        import collections

        from omni_core.pipelines.denoiser import denoisers_of

        first = load_model(contract_model_path)
        specs = denoisers_of(first)
        layers = omni_layers(first)
        assert layers, f"{type(first).__name__}'s denoisers hold no OmniAttention layer"
        for spec in specs:
            for name, processor in getattr(spec.module, "attn_processors", {}).items():
                assert not type(processor).__module__.startswith("diffusers."), \
                    f"{spec.name}.{name} still runs diffusers' {type(processor).__name__}, not an Omni processor"
        # per_role by role, then by role category: the selection names where it came from
        role, backend = layers[0].role, layers[0].backend_name  # the platform's default here, named explicitly
        by_role = load_model(contract_model_path, attention_config={"per_role": {role: backend}})
        for layer in omni_layers(by_role):
            if layer.role == role:
                assert (layer.backend_name, layer.selection.source) == (backend, f"per_role[{role!r}]")
            else:
                assert layer.selection.source != f"per_role[{role!r}]"
        categorised = next((layer for layer in layers if layer.role_category not in (None, layer.role)), None)
        if categorised is not None:  # a model role (e.g. "joint") is chosen by its category too
            category = categorised.role_category
            by_category = load_model(contract_model_path, attention_config={"per_role": {category: backend}})
            assert {layer.selection.source for layer in omni_layers(by_category) if layer.role_category == category
                    } == {f"per_role[{category!r}] (role category)"}
        # a batch of requests (one with a negative prompt) is one call per layer and step
        calls: collections.Counter = collections.Counter()
        hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: calls.update([i]))
                 for i, layer in enumerate(layers)]
        steps = 2
        prompts = self._prompts(type(first))
        states = [make_state(first, prompts[0], seed=1, negative_prompt="blurry",
                             **{**self.sampling, "num_inference_steps": steps}),
                  make_state(first, prompts[1], seed=2, **{**self.sampling, "num_inference_steps": steps})]
        try:
            first.forward(states)
        finally:
            for h in hooks:
                h.remove()
        assert set(calls.values()) <= set(range(1, steps + 1)), \
            f"a layer ran more than once per step for one batch: {dict(calls)}"
        assert sum(calls.values()) == steps * len(layers) // len(specs), \
            f"{sum(calls.values())} attention calls for {steps} steps over {len(layers)} layers in {len(specs)} " \
            f"denoiser(s): the requests' rows were not one call per layer and step"

    def test_preview_and_output_keep_a_non_square_size(self, contract_pipeline: Any) -> None:
        from omni_core.config import SamplingParams

        p = contract_pipeline
        cls = type(p)
        base = cls.check_sampling_params(SamplingParams(**self.sampling), getattr(p, "omni_model_path", None))
        height, width = base.height, base.width + max(cls.size_multiple, 8)
        state = make_state(p, self._prompts(cls)[0], seed=4,
                           **{**self.sampling, "height": height, "width": width, "num_inference_steps": 2})
        p.prepare_encode(state)
        for st, pred in zip([state], p.denoise_step([state])):  # a preview may need one step's estimate
            p.step_scheduler(st, pred)
        preview = p.preview(state)
        assert preview is not None, f"{cls.__name__}.preview gave None after a step"
        assert preview.dim() == 3 and preview.shape[0] == 3
        assert preview.shape[1] * width == preview.shape[2] * height, \
            f"a {height} x {width} request's preview is {tuple(preview.shape[1:])}: another aspect ratio"
        assert 0 <= float(preview.min()) and float(preview.max()) <= 1
        (out,) = p.forward([make_state(p, self._prompts(cls)[0], seed=4, **{**self.sampling, "height": height,
                                                                              "width": width,
                                                                              "num_inference_steps": 2})])
        assert tuple(out.tensor.shape[-2:]) == (height, width)
        out = cls.post_process(out, state.request)
        first = out.images[0] if out.images else None
        if first is not None and hasattr(first, "size") and not callable(first.size):  # a PIL image
            assert first.mode == "RGB" and first.size[0] * height == first.size[1] * width, \
                f"a {height} x {width} request gave a {first.size[1]} x {first.size[0]} image"
