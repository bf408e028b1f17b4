"""Max parity diffs of Omni's FLUX.2 pipelines against diffusers' own on the tiny folders (a request batch of 3
prompts of different lengths, CFG off and on for [klein]; a step batch admitted at steps 0/1/2; a reference image),
one torch thread as in the tests. ``python plugins/models/flux2/tests/parity_report.py`` (pytest skips it)."""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_parity import MSL, STEPS, pictures  # noqa: E402

NEG = "blurry, low quality, watermark, jpeg artifacts"
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn", "a cat",
           "an astronaut riding a green horse on the moon"]


def main() -> None:
    from omni_core.testing import load_model, load_reference, make_state, run_step_batch
    from omni_model_flux2.testing import build_tiny_flux2_dev, build_tiny_flux2_klein

    torch.set_num_threads(1)
    for kind, build in (("klein", build_tiny_flux2_klein), ("dev", build_tiny_flux2_dev)):
        folder = build(tempfile.mkdtemp())
        ref_pipe, omni = load_reference(folder), load_model(folder)

        def reference(prompt, seed, negative, g, images=(), **size):
            kw = {}
            if negative and kind == "klein":
                kw["negative_prompt_embeds"] = ref_pipe.encode_prompt(prompt=[negative], max_sequence_length=MSL)[0]
            if images:
                kw["image"] = list(images)
            return ref_pipe(prompt=prompt, guidance_scale=g, num_inference_steps=STEPS, max_sequence_length=MSL,
                            output_type="pt", generator=torch.Generator("cpu").manual_seed(seed),
                            **{"height": 16, "width": 16, **size}, **kw).images

        def state(prompt, seed, negative, g, images=(), **size):
            return make_state(omni, prompt, seed=seed, negative_prompt=negative, guidance_scale=g, images=list(images),
                              num_inference_steps=STEPS, max_sequence_length=MSL, **{"height": 16, "width": 16, **size})

        def report(label, cases, outs):
            diff = levels = 0.0
            for case, out in zip(cases, outs):
                ref = reference(*case[:4], **case[4] if len(case) > 4 else {})
                diff = max(diff, (out.tensor - ref).abs().max().item())
                levels = max(levels, ((out.tensor * 255).round() - (ref * 255).round()).abs().max().item())
            print(f"{kind} {label}: max |diff| {diff:.1e} ({levels:.0f} levels of 255)")

        for g in (1.0, 4.0):
            cases = [(p, 10 + i, NEG if g > 1 else None, g) for i, p in enumerate(PROMPTS)]
            report(f"request batch of 3, guidance {g}", cases, omni.forward([state(*c) for c in cases]))
        cases = [(PROMPTS[0], 1, NEG, 4.0), (PROMPTS[1], 2, None, 1.0), (PROMPTS[2], 3, NEG, 3.0, {"width": 24})]
        report("step batch admitted at steps 0/1/2", cases,
               run_step_batch(omni, [state(*c[:4], **(c[4] if len(c) > 4 else {})) for c in cases], admit_at=[0, 1, 2]))
        pics = pictures()
        cases = [(PROMPTS[0], 4, NEG, 4.0, {"images": (pics[0],)}), (PROMPTS[1], 5, None, 4.0, {"images": (pics[0],)})]
        report("reference image, batch of 2", cases, omni.forward([state(*c[:4], **c[4]) for c in cases]))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
