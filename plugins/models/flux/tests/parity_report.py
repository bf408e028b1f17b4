"""Max parity diffs of Omni's FluxPipeline against diffusers' own on the tiny dev and schnell folders (the cases
of ``test_flux.py``: a request batch of 3 prompts with CFG off and on, a step batch with staggered admission),
one torch thread as in the tests. ``python plugins/models/flux/tests/parity_report.py`` (pytest skips it)."""

from __future__ import annotations

import os
import tempfile

import torch

STEPS, MSL = 3, 64
NEG = "blurry, low quality, watermark, jpeg artifacts"
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn", "a cat",
           "an astronaut riding a green horse on the moon"]


def main() -> None:
    from omni_core.config import OmniDiffusionConfig, SamplingParams
    from omni_core.pipelines import StepState, load_pipeline, resolve_model
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline
    from omni_core.request import OmniDiffusionRequest
    from omni_core.testing.driver import run_step_batch
    from omni_model_flux.testing import build_tiny_flux

    torch.set_num_threads(1)
    for kind, dev in (("dev", True), ("schnell", False)):
        folder = build_tiny_flux(tempfile.mkdtemp(), guidance_embeds=dev)
        ref_pipe = load_diffusers_pipeline(folder)
        omni = load_pipeline(resolve_model(folder), OmniDiffusionConfig(model=folder, dtype="float32"), "cpu",
                             torch.float32)

        def reference(prompt, seed, negative, cfg, width=16):
            return ref_pipe(prompt, negative_prompt=negative, true_cfg_scale=cfg, height=16, width=width,
                            num_inference_steps=STEPS, max_sequence_length=MSL, output_type="pt",
                            generator=torch.Generator("cpu").manual_seed(seed)).images

        def state(prompt, seed, negative, cfg, width=16):
            params = type(omni).check_sampling_params(SamplingParams(
                height=16, width=width, num_inference_steps=STEPS, true_cfg_scale=cfg, seed=seed,
                max_sequence_length=MSL), folder)
            return StepState(request=OmniDiffusionRequest(prompt=prompt, negative_prompt=negative,
                                                          sampling_params=params),
                             generator=torch.Generator("cpu").manual_seed(seed))

        def report(label, cases, outs):
            diff = levels = 0.0
            for case, out in zip(cases, outs):
                ref = reference(*case)
                diff = max(diff, (out.tensor - ref).abs().max().item())
                levels = max(levels, ((out.tensor * 255).round() - (ref * 255).round()).abs().max().item())
            print(f"{kind} {label}: max |diff| {diff:.2e} ({levels:.0f} levels of 255)")

        for cfg in (1.0, 4.0):
            cases = [(p, 10 + i, NEG if cfg > 1 else None, cfg) for i, p in enumerate(PROMPTS)]
            report(f"request batch of 3, true_cfg_scale {cfg}", cases, omni.forward([state(*c) for c in cases]))
        cases = [(PROMPTS[0], 1, NEG, 4.0), (PROMPTS[1], 2, None, 1.0), (PROMPTS[2], 3, NEG, 3.0, 24)]
        report("step batch admitted at steps 0/1/2", cases,
               run_step_batch(omni, [state(*c) for c in cases], admit_at=[0, 1, 2]))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
