"""``DiffusersParityContract``: an Omni model pipeline computes what diffusers' own pipeline computes, in every
way the engine batches it. A pytest class to subclass, as diffusers' ``PipelineTesterMixin`` is::

    from omni_core.testing import DiffusersParityContract

    class TestMyModelParity(DiffusersParityContract):
        build_model = staticmethod(build_tiny_my_model)   # tiny-folder builder: build_model(path) -> folder
        sampling = {"num_inference_steps": 3, "height": 32, "width": 32}   # tiny and fast
        cfg_field, cfg_scale, cfg_off = "guidance_scale", 4.0, 1.0

Every check runs the Omni pipeline (loaded through the real entry point, ``resolve_model`` and ``load_pipeline``)
and diffusers' pipeline (``DiffusionPipeline.from_pretrained`` on the same folder, one prompt per call, the
request's seed in a CPU generator) and holds each Omni output to at most ``levels`` of 255 from diffusers' and
the final latents to ``latents_atol``:

* ``test_request_batch_matches_diffusers[cfg-off|cfg-on|cfg-mixed]``: three prompts of different lengths as ONE
  request batch (``pipeline.forward``), CFG off, on, and on for every other request; the first alone too; each
  step one denoiser call holding every request's rows;
* ``test_step_mode_staggered_matches_diffusers``: step mode, requests admitted at waves 0, 1, 2 (CFG on, off,
  on; the last of another size, ``other_size``) so one ``denoise_step`` holds requests at different steps;
  every wave calls each denoiser (expert) once, its rows each request's cond rows and the uncond rows of the
  guided ones (``alone_folds_branches=False``: a request alone may run its branches as two calls);
* ``test_several_outputs_non_square_matches_diffusers``: ``num_outputs_per_prompt=2`` at ``non_square``;
* ``test_a_wave_is_one_call_per_step_and_equals_each_alone`` ("batched equals one by one", "CFG branches
  folded"): four requests (different prompts, CFG scales, negatives, two outputs, one unguided) as one wave:
  one denoiser call per step with every row, and each result equal to the request run alone;
* ``test_engine_matches_diffusers[request-batch|step-batch]``: ``Omni(<folder>).generate`` end to end, PIL
  images (video frames) within one level of diffusers' (``engine_modes`` keeps fewer: e.g. the further layouts of
  one pipeline class, whose engine path is the same);
* ``test_parity_check_has_teeth``: another seed, or the CFG scale off by one, fails the parity assertion.

Input images (edit, image-to-video): set ``images_per_request`` and override ``input_images()``; a case's
images are handed to diffusers as ``image=`` and to Omni as ``request.images``.

A subclass adds the model's own parity tests as methods using ``self.omni`` (the loaded Omni pipeline),
``self.diffusers``, ``self.model_path``, ``self.case(...)``, ``self.make_state(case)``, ``self.reference(case)``
and ``self.assert_parity(state, output, case)``. Folders and pipelines are built once per class (or taken from
the session fixtures :func:`tiny_model_fixtures` makes, named by ``tiny_model``, shared with the plugin's
other tests), and diffusers' outputs are memoised per session: keep the cases of added tests equal to
the contract's where possible.
"""

from __future__ import annotations

from typing import Any

import pytest

from omni_core.testing.driver import run_step_batch
from omni_core.testing.parity_harness import ParityHarness, levels_apart, load_reference, tiny_model_fixtures

__all__ = ["DiffusersParityContract", "levels_apart", "load_reference", "tiny_model_fixtures"]


class DiffusersParityContract(ParityHarness):
    """The checks of the module docstring; what a model sets, and the helpers its own tests call, are
    :class:`~omni_core.testing.parity_harness.ParityHarness`'s."""

    def test_folder_resolves_to_the_omni_pipeline(self) -> None:
        from omni_core.pipelines import resolve_model
        from omni_core.pipelines.base import read_model_index

        expected = self.pipeline_class or read_model_index(self.model_path)["_class_name"]
        assert read_model_index(self.model_path)["_class_name"] == expected
        assert resolve_model(self.model_path).spec.name == expected

    def request_cases(self, cfg: str) -> list[dict[str, Any]]:
        """The request batch of ``cfg`` mode ("off", "on", "mixed": on for even requests): prompt i, seed i."""
        return [self.case(i, seed, cfg={"off": False, "on": True, "mixed": i % 2 == 0}[cfg])
                for i, seed in enumerate(self.seeds[:self.request_batch])]

    @pytest.mark.parametrize("cfg", ["off", "on", "mixed"], ids=["cfg-off", "cfg-on", "cfg-mixed"])
    def test_request_batch_matches_diffusers(self, cfg: str) -> None:
        if cfg not in self.cfg_modes:
            pytest.skip(f"{type(self).__name__}.cfg_modes = {self.cfg_modes}")
        cases = self.request_cases(cfg)
        alone = self.make_state(cases[0])
        (out,) = self.omni.forward([alone])
        assert out.finished and out.status == "completed"
        self.assert_parity(alone, out, cases[0])
        states = [self.make_state(c) for c in cases]
        outs, steps = self.forward_one_call_per_step(states, "one request batch")
        for state, out, case in zip(states, outs, cases):
            assert out.finished and out.status == "completed" and out.num_steps == steps
            self.assert_parity(state, out, case)

    def staggered_cases(self) -> list[dict[str, Any]]:
        """Requests of the step-mode check, admitted at waves 0, 1, 2, ... (CFG on, off, on at another scale
        and size): the first two are batch cases, so their diffusers runs are shared."""
        return [self.case(0, self.seeds[0]), self.case(1, self.seeds[1], cfg=False),
                self.case(2, self.seeds[2] + 1, cfg=(self.cfg_scale + self.cfg_off) / 2 + 0.5, **self.other_size)]

    def test_step_mode_staggered_matches_diffusers(self) -> None:
        cases = self.staggered_cases()
        states = [self.make_state(c) for c in cases]
        waves: list[list[tuple[Any, int]]] = []
        experts: list[set[str]] = []
        denoise = self.omni.denoise_step
        with self.denoiser_calls() as calls:
            def spy(batch: list) -> list:
                before = len(calls)
                waves.append([(s, s.step_index) for s in batch])
                out = denoise(batch)
                self.check_wave(calls[before:], waves[-1])
                experts.append({name for name, _, _ in calls[before:]})
                return out

            self.omni.denoise_step = spy
            try:
                outs = run_step_batch(self.omni, states, admit_at=list(range(len(states))))
            finally:
                del self.omni.denoise_step
        assert any(len({step for _, step in w}) == len(states) for w in waves), \
            "no denoise_step held every request, each at its own step"
        if len(set().union(*experts)) > 1:
            assert any(len(e) > 1 for e in experts), "no wave held requests on different experts"
        for state, out, case in zip(states, outs, cases):
            self.assert_parity(state, out, case)

    def test_several_outputs_non_square_matches_diffusers(self) -> None:
        if not self.non_square:
            pytest.skip(f"{type(self).__name__}: no non_square size set")
        case = self.case(2, 5, num_outputs_per_prompt=2, **self.non_square)
        state = self.make_state(case)
        (out,) = self.omni.forward([state])
        assert out.tensor.shape[0] == 2 and tuple(out.tensor.shape[-2:]) == \
            (self.non_square["height"], self.non_square["width"])
        self.assert_parity(state, out, case)

    def batch_cases(self) -> list[dict[str, Any]]:
        """Four requests of one wave: prompts of different lengths, CFG scales, negative prompts, two outputs
        per prompt, and one without CFG."""
        return [self.case(0, 1), self.case(1, 2, cfg=(self.cfg_scale + self.cfg_off) / 2, num_outputs_per_prompt=2),
                self.case(2, 3, negative="ugly"), self.case(1, 4, cfg=False)]

    def forward_one_call_per_step(self, states: list, what: str) -> tuple[list, int]:
        """Run ``states`` as one batch and check the denoiser ran once per step with every state in the call;
        (the outputs, the step count)."""
        with self.denoiser_calls() as calls:
            outs = self.omni.forward(states)
        steps = states[0].num_steps
        assert len(calls) == steps, f"{len(calls)} denoiser calls for {steps} steps of {what}"
        for step, call in enumerate(calls):
            self.check_wave([call], [(s, step) for s in states])
        return outs, steps

    def test_a_wave_is_one_call_per_step_and_equals_each_alone(self) -> None:
        import torch

        cases = self.batch_cases()
        batched = [self.make_state(c) for c in cases]
        outs, steps = self.forward_one_call_per_step(batched, "one wave")
        for case, state, out in zip(cases, batched, outs):
            alone = self.make_state(case)
            (ref,) = self.omni.forward([alone])
            torch.testing.assert_close(state.latents, alone.latents, atol=self.batch_latents_atol, rtol=0)
            torch.testing.assert_close(out.tensor, ref.tensor, atol=self.batch_atol, rtol=0)

    def test_parity_check_has_teeth(self) -> None:
        """Another seed, or the CFG scale off by one, is far outside the parity tolerance."""
        case = self.case(1, self.seeds[1])
        for wrong in ({**case, "seed": case["seed"] + 1}, {**case, self.cfg_field: case[self.cfg_field] + 1}):
            state = self.make_state(wrong)
            (out,) = self.omni.forward([state])
            with pytest.raises(AssertionError):
                self.assert_parity(state, out, case)

    @pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
    def test_engine_matches_diffusers(self, step_execution: bool) -> None:
        import numpy as np
        from diffusers.image_processor import VaeImageProcessor

        from omni_core import Omni

        mode = "step-batch" if step_execution else "request-batch"
        if mode not in self.engine_modes:
            pytest.skip(f"{type(self).__name__}.engine_modes = {self.engine_modes}")
        seed = self.seeds[0] + 11
        cases = [self.case(i, seed, negative=self.negative_prompt if i == 0 else None, **self.engine_fields)
                 for i in range(self.engine_requests)]
        pics = self.input_images()
        prompts = [{"prompt": c["prompt"], **({"negative_prompt": c["negative_prompt"]} if c["negative_prompt"] else {}),
                    **({"image": [pics[i] for i in c["images"]]} if c["images"] else {})} for c in cases]
        _, _, _, _, fields = self._split(cases[0])
        with Omni(self.model_path, dtype="float32", warmup=False, max_num_seqs=len(cases),
                  step_execution=step_execution, **self.engine_kwargs) as omni:
            outs = omni.generate(prompts, seed=seed, use_tqdm=False, **fields)
        for out, case in zip(outs, cases):
            ref = self.reference(case)[0][0]
            want = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(ref if ref.dim() == 4 else ref[None]))
            got = out.images[0] if isinstance(out.images[0], list) else [out.images[0]]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                diff = np.abs(np.asarray(g, dtype=np.int16) - np.asarray(w, dtype=np.int16)).max()
                assert diff <= self.levels, f"{diff} levels of 255 apart from diffusers ({case['prompt']!r})"
