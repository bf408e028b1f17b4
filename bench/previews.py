"""Preview fidelity: how close a streamed preview of a mid-run step is to the picture that step points at.

    python bench/previews.py [--models shapes,qwen-image,wan,flux,z-image] [--steps 8] [--calib 4] [--eval 4]

For every first-party model (the shipped ``shapes`` weights; tiny random-weight folders of the others, built as
the tests build them), ``--calib`` prompts (seeds 0..) run ``--steps`` steps and give a projection fitted by
``omni preview calibrate``'s code (clean estimates after 1/4, 1/2, 3/4 and all of the steps, VAE-decoded);
then ``--eval`` other prompts (seeds 1000..) run to the middle step, and each preview of that step is compared
with the VAE decode of the step's clean estimate ``x0`` (what the final image will look like if nothing
changes), area-averaged to the preview's size (the latent grid). PSNR in dB, mean over the eval prompts
(a video: over all its latent frames; the channel previews show the middle frame, as they did):

* ``channel x_t``: the preview before this change in ``DiffusersStepPipeline`` (first three channels of the
  current, noisy latents, min-max scaled);
* ``channel x0``: the same on the clean estimate (how much of the gain is the estimate alone);
* ``3xC``: a plain ``3 x C`` projection (one latent pixel -> its RGB) fitted on the clean estimates;
* ``projection``: what ``omni preview calibrate`` writes and previews use: the neighbourhood size ``k``
  (1, 3 or 5) chosen on held-out calibration prompts (``k = 1`` is the ``3xC`` one), fitted on all of them;
* ``shipped``: the projection the plugin ships for this VAE, when it matches (tiny random VAEs match none,
  except ``shapes``, whose exact one is shipped; its own preview already was the clean estimate).

``margin`` = projection - channel x_t; issue #37 asks for >= 6 dB.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = ("shapes", "qwen-image", "wan", "flux", "z-image")
#: request sizes: the tiny models' (the tests'), not the real models' defaults, so a VAE decode takes well under a second
SAMPLING = {"shapes": {}, "qwen-image": {"height": 64, "width": 64}, "flux": {"height": 64, "width": 64},
            "z-image": {"height": 64, "width": 64}, "wan": {"height": 32, "width": 32, "num_frames": 9}}


def build(model: str, root: str) -> str:
    """A folder (or model name) for ``model``: tiny random weights as the tests build them."""
    if model == "shapes":
        return "shapes"
    path = os.path.join(root, model)
    if model == "qwen-image":
        from omni_core.testing.diffusers_folders import build_tiny_qwen_image
        return build_tiny_qwen_image(path)
    if model == "wan":
        from omni_model_wan.testing import build_tiny_wan
        return build_tiny_wan(path)
    if model == "flux":
        from omni_model_flux.testing import build_tiny_flux
        return build_tiny_flux(path)
    if model == "z-image":
        from omni_model_z_image.testing import build_tiny_z_image
        return build_tiny_z_image(path)
    raise SystemExit(f"unknown model {model!r}; one of {', '.join(MODELS)}")


def measure(pipeline, model_path: str | None, *, steps: int, calib: int, evals: int, sampling: dict) -> dict:
    """The bench's numbers for one loaded pipeline (see the module docstring)."""
    from omni_core.pipelines.preview import channel_preview, find_projection
    from omni_core.pipelines.preview_fit import choose_kernel, collect_pairs, fit_projection, psnr

    prompts = list(type(pipeline).example_prompts())
    calib_prompts = [prompts[i % len(prompts)] for i in range(calib)]
    eval_prompts = [prompts[(calib + i) % len(prompts)] for i in range(evals)]
    t0 = time.perf_counter()
    cal = collect_pairs(pipeline, calib_prompts, model_path=model_path, steps=steps, seed=0, sampling=sampling)
    kernel, _ = choose_kernel(cal)
    proj = fit_projection([(r["latents"], r["target"]) for r in cal], kernel=kernel)
    calib_s = time.perf_counter() - t0
    ev = collect_pairs(pipeline, eval_prompts, model_path=model_path, steps=steps, seed=1000, at=(0.5,),
                       sampling=sampling)
    plain = proj if kernel == 1 else fit_projection([(r["latents"], r["target"]) for r in cal])
    vae_cfg = pipeline.preview_vae_config() if hasattr(pipeline, "preview_vae_config") else {}
    shipped, _ = find_projection(type(pipeline), None, int(ev[0]["latents"].shape[0]), vae_cfg)

    def middle(t):  # [3, F, h, w] -> the middle frame; images unchanged
        return t[:, t.shape[1] // 2] if t.dim() == 4 else t

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs)

    row = {
        "latent": "x".join(str(d) for d in ev[0]["latents"].shape),
        "step": f"{ev[0]['step']}/{ev[0]['num_steps']}",
        "channel x_t": mean(psnr(channel_preview(r["current"]), middle(r["target"])) for r in ev),
        "channel x0": mean(psnr(channel_preview(r["latents"]), middle(r["target"])) for r in ev),
        "3xC": mean(psnr(plain.apply(r["latents"]), r["target"]) for r in ev),
        "k": kernel,
        "projection": mean(psnr(proj.apply(r["latents"]), r["target"]) for r in ev),
        "shipped": mean(psnr(shipped.apply(r["latents"]), r["target"]) for r in ev) if shipped else None,
        "calib decodes": len(cal), "calib s": calib_s,
    }
    row["margin"] = row["projection"] - row["channel x_t"]
    return row


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.1f}"
    return str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--calib", type=int, default=4, help="calibration prompts (4 decodes each)")
    p.add_argument("--eval", type=int, default=4, help="evaluation prompts (other prompts and seeds)")
    args = p.parse_args()

    import torch

    from omni_core.testing._model import load_model

    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="omni-bench-previews-")
    cols = ["latent", "step", "channel x_t", "channel x0", "3xC", "k", "projection", "shipped", "margin",
            "calib decodes",
            "calib s"]
    print(f"bench/previews.py --steps {args.steps} --calib {args.calib} --eval {args.eval}; torch threads "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    print("PSNR (dB) of a mid-run preview against the VAE decode of that step's clean estimate, at preview size")
    print("| model | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for model in args.models.split(","):
        folder = build(model, root)
        pipeline = load_model(folder)
        row = measure(pipeline, getattr(pipeline, "omni_model_path", None), steps=args.steps, calib=args.calib,
                      evals=args.eval, sampling=SAMPLING.get(model, {}))
        size = "x".join(str(v) for v in SAMPLING.get(model, {}).values()) or "default: 32x32"
        print(f"| {model} ({size}) | " + " | ".join(fmt(row[c]) for c in cols) + " |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
