"""A small GRPO trainer that samples through Omni (docs/rollouts.md): Flow-GRPO on the ``shapes`` model.

    .venv/bin/python docs/examples/grpo_shapes.py [--iterations 10] [--prompts 4] [--group 8] [--steps 4]

Four prompts drawn once from the model's own scene vocabulary (``--new-prompts``: new ones every iteration). Each
iteration: sample ``--group`` images per prompt through Omni
with a rollout (the ``sde`` step, its log-probabilities and the latent trajectory come back with the images), score
each image with the shapes judge (colour, shape and position read off the image: the reward is the fraction right),
normalise the rewards within each prompt's group (the GRPO advantage), recompute each transition's log-probability
under the trainer's copy of the transformer (the same formula, ``flow_sde_step`` with ``prev_sample``: at the first
update it equals Omni's, which the script checks), take a clipped policy-gradient step, and send the new weights to
the engine (``Omni.update_weights``: no restart, the checksum compared). The mean reward per iteration is printed;
it rises.

Everything here is the trainer's side of a real RL loop; Omni only samples, scores transitions and takes weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from typing import Any


def reward(images: Any, scenes: list) -> list[float]:
    """The fraction of (colour, shape, position) the judge reads right, per image."""
    from omni_model_shapes import judge

    _, judgements = judge.score(images, scenes)
    return [((j.colour == s.colour) + (j.shape == s.shape) + (j.position == s.position)) / 3
            for j, s in zip(judgements, scenes)]


def train(iterations: int = 10, prompts: int = 4, group: int = 8, steps: int = 4, noise_level: float = 1.2,
          lr: float = 3e-4, clip: float = 0.2, seed: int = 0, fixed_prompts: bool = True,
          log: Any = print) -> list[list[float]]:
    """Run the loop; returns every iteration's rewards (one per sample)."""
    import torch

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.pipelines import resolve_model
    from omni_core.pipelines.flow_sde import flow_sde_step
    from omni_core.testing import load_model
    from omni_model_shapes import data
    from omni_model_shapes.models import velocity

    folder = os.path.join(tempfile.mkdtemp(prefix="grpo-shapes-"), "shapes")
    shutil.copytree(resolve_model("shapes").model_path, folder)
    policy = load_model(folder)  # the trainer's copy: the same folder, loaded in this process
    transformer = policy.transformer.float().eval().requires_grad_(True)  # eval: no dropout, the sampler's function
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    history: list[list[float]] = []
    rollout = {"sde_type": "sde", "noise_level": noise_level, "trajectory": True}
    with Omni(folder, warmup=False, cpu_threads=1, step_execution=True, limits={"max_outputs": group}) as omni:
        fixed = data.sample_scenes(prompts, generator, size_word_prob=0.0)
        for it in range(iterations):
            scenes = fixed if fixed_prompts else data.sample_scenes(prompts, generator, size_word_prob=0.0)
            params = [SamplingParams(seed=seed * 100_000 + it * 100 + k, num_outputs_per_prompt=group, guidance_scale=1.0,
                                     num_inference_steps=steps, output_type="pt", rollout=rollout)
                      for k in range(prompts)]
            outs = omni.generate([s.prompt for s in scenes], sampling_params=params, use_tqdm=False)
            rewards = [reward(out.tensor, [scene] * group) for out, scene in zip(outs, scenes)]
            history.append([r for rs in rewards for r in rs])
            log(f"iteration {it}: mean reward {statistics.mean(history[-1]):.3f}")
            optimizer.zero_grad()
            for out, scene, rs in zip(outs, scenes, rewards):
                advantage = torch.tensor(rs)
                advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-4)
                emb, mask = policy.encode_prompt(scene.prompt, None)
                r = out.rollout
                for w in range(len(r["steps"])):
                    x, prev = r["latents"][:, w], r["latents"][:, w + 1]
                    t = torch.full((group,), float(r["timesteps"][w]))
                    sigma, sigma_next = (float(s) for s in r["sigmas"][w])
                    model_out = transformer(x, t, emb.expand(group, -1, -1), mask.expand(group, -1))
                    v = velocity(model_out.float(), x, torch.full((group,), sigma), transformer.config.prediction_type)
                    new = flow_sde_step(v, x, sigma, sigma_next, noise_level=noise_level,
                                        sigma_max=float(r["sigmas"][0][1]), prev_sample=prev).log_prob
                    old = r["log_probs"][:, w]
                    if it == 0 and w == 0:  # the trainer's recomputation agrees with what Omni sampled with
                        assert torch.allclose(new.detach(), old, atol=1e-3), (new, old)
                    ratio = torch.exp(new - old)
                    loss = -torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage).mean()
                    (loss / (prompts * len(r["steps"]))).backward()
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
            optimizer.step()
            state = {k: v.detach() for k, v in transformer.state_dict().items()}
            checksum = omni.update_weights(state)
            assert checksum == omni.weights_checksum()
    return history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--noise-level", type=float, default=1.2, help="the SDE's eta: the sampler explores, the "
                   "policy learns to stay right under it")
    p.add_argument("--new-prompts", action="store_true", help="new prompts every iteration")
    args = p.parse_args()
    history = train(args.iterations, args.prompts, args.group, args.steps, noise_level=args.noise_level, lr=args.lr,
                    fixed_prompts=not args.new_prompts)
    first, last = history[0], history[-1]
    print(f"first rollout {statistics.mean(first):.3f}, last {statistics.mean(last):.3f}")


if __name__ == "__main__":
    main()
