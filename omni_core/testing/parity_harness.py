"""The machinery under :class:`~omni_core.testing.parity.DiffusersParityContract`: loading diffusers' reference
pipeline, session fixtures for a tiny model (:func:`tiny_model_fixtures`), the levels-of-255 metric, and
:class:`ParityHarness` (the folder and both pipelines as fixtures, request cases, diffusers' outputs memoised
for the session, the parity assertion, the denoiser-call recorder). The checks themselves are in
:mod:`omni_core.testing.parity`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Iterator

import pytest

from omni_core.testing._model import load_model
from omni_core.testing.driver import make_state

#: diffusers' outputs of the session: (id of the reference pipeline, case key) -> (output, final latents)
_REFERENCES: dict[tuple, tuple[Any, Any]] = {}
#: tiny folders built by ``build_model``, once per session: builder -> folder
_FOLDERS: dict[Any, str] = {}


def load_reference(model_path: str, **components: Any) -> Any:
    """diffusers' own pipeline from a folder (safetensors only, progress bar off); ``components`` are handed to
    ``from_pretrained`` (e.g. a processor transformers cannot load here)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_path, use_safetensors=True, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_model_fixtures(name: str, builder: Callable[..., str], *,
                        reference_components: Callable[[str], dict] | None = None, **build_kwargs: Any) -> tuple:
    """Three session fixtures for a plugin's ``conftest.py``: ``<name>_dir`` (the folder
    ``builder(path, **build_kwargs)`` saves), ``omni_<name>`` (Omni's pipeline from it, :func:`load_model`) and
    ``diffusers_<name>`` (diffusers' own, :func:`load_reference` with ``reference_components(folder)``)::

        flux_dir, omni_flux, diffusers_flux = tiny_model_fixtures("flux", build_tiny_flux, guidance_embeds=True)

    A :class:`DiffusersParityContract` subclass uses them with ``tiny_model = "flux"``.
    """

    @pytest.fixture(scope="session", name=f"{name}_dir")
    def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
        return builder(str(tmp_path_factory.mktemp(f"tiny-{name}")), **build_kwargs)

    @pytest.fixture(scope="session", name=f"omni_{name}")
    def omni(request: pytest.FixtureRequest) -> Any:
        return load_model(request.getfixturevalue(f"{name}_dir"))

    @pytest.fixture(scope="session", name=f"diffusers_{name}")
    def diffusers(request: pytest.FixtureRequest) -> Any:
        path = request.getfixturevalue(f"{name}_dir")
        return load_reference(path, **(reference_components(path) if reference_components else {}))

    return folder, omni, diffusers


def levels_apart(a: Any, b: Any) -> float:
    """The largest difference of two images in [0, 1], in levels of 255."""
    return ((a * 255).round() - (b * 255).round()).abs().max().item()


class ParityHarness:
    """What the contract's checks run on: the class attributes a model sets (first), the folder and both
    pipelines as fixtures, request cases, diffusers' memoised outputs, the parity assertion and the
    denoiser-call recorder."""

    # ------------------------------------------------------------------ what a subclass sets
    #: diffusers' pipeline class name, which Omni's component carries too (default: the folder's
    #: ``model_index.json`` ``_class_name``)
    pipeline_class: ClassVar[str | None] = None
    #: the tiny folder: ``build_model(path) -> folder`` (random weights, built once per session) ...
    build_model: ClassVar[Callable[[str], str] | None] = None
    #: ... or the ``name`` of :func:`tiny_model_fixtures` in the plugin's conftest (folder and both pipelines
    #: shared with the plugin's other tests)
    tiny_model: ClassVar[str | None] = None
    #: ... or the name of any fixture returning a folder (both pipelines then loaded once per class)
    model_fixture: ClassVar[str | None] = None
    #: Omni sampling fields of every case (diffusers takes them under the same names): steps, size, text length
    sampling: ClassVar[dict[str, Any]] = {}
    #: three prompts of different token lengths
    prompts: ClassVar[tuple[str, ...]] = ("a red fox jumping over a lazy dog in a snowy forest at dawn", "a cat",
                                          "an astronaut riding a green horse on the moon")
    negative_prompt: ClassVar[str] = "blurry, low quality, watermark, jpeg artifacts"
    #: the field that sets the CFG scale, a scale with CFG on, and the value that turns it off
    cfg_field: ClassVar[str] = "guidance_scale"
    cfg_scale: ClassVar[float] = 4.0
    cfg_off: ClassVar[float] = 1.0
    #: true CFG (FLUX, Qwen-Image): guided only with a negative prompt
    cfg_needs_negative: ClassVar[bool] = False
    #: diffusers' keyword for ``num_outputs_per_prompt``
    outputs_kwarg: ClassVar[str] = "num_images_per_prompt"
    #: a size that joins a step wave of ``sampling``-sized requests, and the size of the several-outputs check
    #: (empty: the check is skipped)
    other_size: ClassVar[dict[str, int]] = {}
    non_square: ClassVar[dict[str, int]] = {}
    #: input images per request (edit / image-to-video models); the images come from ``input_images()``
    images_per_request: ClassVar[int] = 0
    #: parity with diffusers: levels of 255 per value, and the final latents
    levels: ClassVar[float] = 1
    latents_atol: ClassVar[float] = 5e-5
    #: a request in a wave against the same request alone: final latents, outputs
    batch_latents_atol: ClassVar[float] = 2e-5
    batch_atol: ClassVar[float] = 1e-4
    #: False: a request alone may run its CFG branches as two calls (when its prompts differ in length and the
    #: model folds them only with a padding mask, as diffusers' own shape)
    alone_folds_branches: ClassVar[bool] = True
    #: the engine check: requests (the first with the negative prompt; one seed for all, as ``Omni.generate``
    #: gives it), more sampling fields, and ``Omni(...)`` keywords
    engine_requests: ClassVar[int] = 3
    engine_fields: ClassVar[dict[str, Any]] = {}
    engine_kwargs: ClassVar[dict[str, Any]] = {"cpu_threads": 1}
    #: the engine check's modes: "request-batch", "step-batch" (``Omni(..., step_execution=True)``)
    engine_modes: ClassVar[tuple[str, ...]] = ("request-batch", "step-batch")
    #: seeds of the three batch requests (each request draws its noise from its own generator)
    seeds: ClassVar[tuple[int, ...]] = (10, 11, 12)
    #: requests in the request-batch check, and its CFG modes: all off, all on, mixed (on, off, on: its
    #: diffusers runs are those of the other two); models whose diffusers run is slow keep fewer
    request_batch: ClassVar[int] = 3
    cfg_modes: ClassVar[tuple[str, ...]] = ("off", "on", "mixed")

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def parity_model_path(cls, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
        if cls.tiny_model or cls.model_fixture:
            return request.getfixturevalue(cls.model_fixture or f"{cls.tiny_model}_dir")
        if cls.build_model is None:
            raise pytest.UsageError(f"{cls.__name__}: set `build_model` (a tiny-folder builder) or `tiny_model`")
        if cls.build_model not in _FOLDERS:
            _FOLDERS[cls.build_model] = cls.build_model(str(tmp_path_factory.mktemp("parity") / "model"))
        return _FOLDERS[cls.build_model]

    @pytest.fixture(scope="class")
    @classmethod
    def parity_pipeline(cls, request: pytest.FixtureRequest, parity_model_path: str) -> Any:
        if cls.tiny_model:
            return request.getfixturevalue(f"omni_{cls.tiny_model}")
        return cls.load_pipeline(parity_model_path)

    @pytest.fixture(scope="class")
    @classmethod
    def parity_reference(cls, request: pytest.FixtureRequest, parity_model_path: str) -> Any:
        if cls.tiny_model:
            return request.getfixturevalue(f"diffusers_{cls.tiny_model}")
        return cls.load_reference(parity_model_path)

    @pytest.fixture(autouse=True)
    def _bind_parity(self, parity_model_path: str, parity_pipeline: Any, parity_reference: Any) -> None:
        self.bind(parity_model_path, parity_pipeline, parity_reference)

    def bind(self, model_path: str, pipeline: Any, reference: Any) -> ParityHarness:
        """Set the folder and both pipelines (what the fixtures do; for calling the checks directly)."""
        self.model_path, self.omni, self.diffusers = model_path, pipeline, reference
        return self

    @classmethod
    def load_pipeline(cls, model_path: str) -> Any:
        """Omni's pipeline through the real path: entry point, ``resolve_model``, ``load_pipeline`` (CPU, fp32)."""
        return load_model(model_path)

    @classmethod
    def load_reference(cls, model_path: str) -> Any:
        """diffusers' pipeline from the folder (override to hand in components, e.g. a processor)."""
        return load_reference(model_path)

    def input_images(self) -> list[Any]:
        """The input images cases refer to by index (PIL images)."""
        return []

    # ------------------------------------------------------------------ cases, references, parity
    def case(self, i: int, seed: int, *, cfg: bool | float = True, negative: str | None | bool = True,
             images: tuple[int, ...] | None = None, **fields: Any) -> dict[str, Any]:
        """A request: prompt ``i``, ``seed``, CFG on (``cfg_scale``), off, or at a given scale, the negative
        prompt (True: ``negative_prompt``), input images by index (default: the first ``images_per_request``)
        and Omni sampling fields over ``sampling``."""
        scale = self.cfg_scale if cfg is True else self.cfg_off if cfg is False else cfg
        if negative is True:
            negative = self.negative_prompt if cfg is not False else None
        if images is None:
            images = tuple(range(self.images_per_request))
        return {"prompt": self.prompts[i], "seed": seed, "negative_prompt": negative or None, "images": images,
                **self.sampling, self.cfg_field: scale, **fields}

    @staticmethod
    def _split(case: dict[str, Any]) -> tuple[str, int, str | None, tuple[int, ...], dict[str, Any]]:
        fields = dict(case)
        return fields.pop("prompt"), fields.pop("seed"), fields.pop("negative_prompt"), fields.pop("images"), fields

    def make_state(self, case: dict[str, Any]) -> Any:
        """The Omni ``StepState`` of ``case`` (params checked by the pipeline class with the folder)."""
        prompt, seed, negative, images, fields = self._split(case)
        pics = self.input_images()
        return make_state(self.omni, prompt, seed=seed, negative_prompt=negative, model_path=self.model_path,
                          images=[pics[i] for i in images], **fields)

    def reference_kwargs(self, case: dict[str, Any]) -> dict[str, Any]:
        """diffusers' call keywords for ``case`` (besides prompt, negative prompt, generator, output type)."""
        _, _, _, images, fields = self._split(case)
        kwargs = {k: v for k, v in fields.items() if v is not None}
        kwargs[self.outputs_kwarg] = kwargs.pop("num_outputs_per_prompt", 1)
        if images:
            pics = [self.input_images()[i] for i in images]
            kwargs["image"] = pics[0] if len(pics) == 1 else pics
        return kwargs

    def reference(self, case: dict[str, Any]) -> tuple[Any, Any]:
        """diffusers' output (``[n, 3, H, W]`` images or ``[n, F, 3, H, W]`` videos) and final latents for
        ``case`` alone, memoised for the session."""
        import torch

        key = (id(self.diffusers), tuple(sorted(case.items())))
        if key not in _REFERENCES:
            prompt, seed, negative, _, _ = self._split(case)
            final: dict[str, Any] = {}

            def keep(_pipe: Any, _i: int, _t: Any, kwargs: dict) -> dict:
                final["latents"] = kwargs["latents"]
                return kwargs

            out = self.diffusers(prompt=prompt, negative_prompt=negative, output_type="pt",
                                 generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep,
                                 **self.reference_kwargs(case))
            _REFERENCES[key] = (out[0], final["latents"])
        return _REFERENCES[key]

    def compare_latents(self, latents: Any, ref_latents: Any) -> None:
        import torch

        torch.testing.assert_close(latents, ref_latents, atol=self.latents_atol, rtol=0)

    def assert_parity(self, state: Any, output: Any, case: dict[str, Any]) -> None:
        """``output`` (and ``state``'s final latents) equal diffusers' for ``case`` alone, within tolerance."""
        ref, ref_latents = self.reference(case)
        assert output.tensor.shape == ref.shape, f"shape {tuple(output.tensor.shape)}, diffusers {tuple(ref.shape)}"
        diff = levels_apart(output.tensor, ref)
        assert diff <= self.levels, f"{diff} levels of 255 apart from diffusers ({case['prompt']!r})"
        self.compare_latents(state.latents, ref_latents)

    def guided_at(self, state: Any, step: int) -> bool:
        """Whether ``state`` runs an uncond branch at ``step`` (override for models that drop it on some steps)."""
        sp = state.request.sampling_params
        scale = getattr(sp, self.cfg_field, None)
        if scale is None:
            scale = sp.model_fields.get(self.cfg_field)
        return scale is not None and scale > self.cfg_off and (bool(state.request.negative_prompt)
                                                                or not self.cfg_needs_negative)

    @contextlib.contextmanager
    def denoiser_calls(self) -> Iterator[list[tuple[str, Any, int]]]:
        """Inside the block, every call of a declared denoiser: ``(name, DenoiseCall, batch rows)``."""
        from omni_core.forward_context import forward_context
        from omni_core.pipelines.denoiser import denoisers_of

        calls: list[tuple[str, Any, int]] = []

        def hook(spec: Any) -> Callable:
            def pre(module: Any, args: tuple, kwargs: dict) -> None:
                x = args[0] if args else kwargs[spec.batch_args[0]]
                calls.append((spec.name, forward_context().call, x.shape[0]))
            return pre

        handles = [spec.module.register_forward_pre_hook(hook(spec), with_kwargs=True)
                   for spec in denoisers_of(self.omni)]
        try:
            yield calls
        finally:
            for h in handles:
                h.remove()

    def check_wave(self, calls: list[tuple[str, Any, int]], wave: list[tuple[Any, int]]) -> None:
        """The calls of one wave (``(state, step)`` pairs): each denoiser called once per latent size (twice for a
        request alone at its size when ``alone_folds_branches`` is False), covering every state's cond rows and the guided
        ones' uncond rows."""
        per_expert: dict[str, int] = {}
        rows: dict[tuple[int, str], int] = {}
        for name, call, batch in calls:
            assert call is not None and call.covers(batch), f"{name}: a call whose context does not cover its rows"
            per_expert[name] = per_expert.get(name, 0) + 1
            for g in call.groups:
                rows[(id(g.state), g.branch)] = rows.get((id(g.state), g.branch), 0) + g.rows
        by_size: dict[tuple, int] = {}  # latents of another size: a call of their own
        for state, _ in wave:
            by_size[tuple(state.latents.shape[1:])] = by_size.get(tuple(state.latents.shape[1:]), 0) + 1
        most = sum(2 if n == 1 and not self.alone_folds_branches else 1 for n in by_size.values())
        assert per_expert and max(per_expert.values()) <= most, f"a wave of {len(wave)} requests " \
            f"({len(by_size)} size(s)) made {per_expert} denoiser calls (expected one per denoiser and size)"
        expected = {}
        for state, step in wave:
            n = state.request.sampling_params.num_outputs_per_prompt
            expected[(id(state), "cond")] = n
            if self.guided_at(state, step):
                expected[(id(state), "uncond")] = n
        assert rows == expected, "the wave's calls do not hold exactly each request's cond rows and the guided " \
                                 f"ones' uncond rows: {sorted(rows.values())} vs {sorted(expected.values())}"


__all__ = ["ParityHarness", "levels_apart", "load_reference", "tiny_model_fixtures"]
