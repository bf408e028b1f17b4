"""Train the shapes model from a seed on the CPU: ``python -m omni_model_shapes.train --seed 0 --out DIR``.

Rectified-flow (flow-matching) training in pixel space on the procedural data set: ``x_t = (1 - s) x + s e``,
the transformer predicts ``e - x`` (the velocity diffusers' ``FlowMatchEulerDiscreteScheduler`` integrates).
The prompt is dropped with probability ``text_drop`` so classifier-free guidance works. Everything is
drawn from the seed (model init, data, noise), the iteration count is fixed, and an EMA of the weights
is saved with ``save_pretrained`` as a diffusers-style folder the pipeline loads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from omni_model_shapes import data
from omni_model_shapes.models import velocity
from omni_model_shapes.tokenizer import ShapesTokenizer


@dataclass
class TrainConfig:
    seed: int = 0
    iterations: int = 3500
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 200
    #: final learning rate as a fraction of ``lr`` (cosine decay)
    min_lr_ratio: float = 0.05
    ema_decay: float = 0.999
    text_drop: float = 0.1
    #: "uniform" or "logit_normal" noise levels
    sigma_sampling: str = "uniform"
    #: for prediction_type "sample": the velocity loss divides by max(sigma, this)
    sigma_floor: float = 0.05
    size_word_prob: float = 0.3
    #: one thread: the result does not depend on the machine's core count, and on a shared machine a second
    #: thread mostly waits (measured: 3x the CPU time per iteration under load)
    threads: int = 1
    #: bfloat16 autocast for the forward pass (weights, optimizer and EMA stay float32); no faster on one core
    bf16: bool = False
    image_size: int = 32
    transformer: dict = field(default_factory=lambda: dict(patch_size=4, dim=128, num_layers=6, num_heads=4,
                                                           mlp_ratio=3.0, prediction_type="sample"))
    text_encoder: dict = field(default_factory=lambda: dict(dim=128, num_layers=2, num_heads=4, mlp_ratio=2.0))
    max_length: int = 16
    log_every: int = 100
    #: also save the EMA weights every this many iterations to ``<out>/checkpoint-<it>`` (0: never)
    checkpoint_every: int = 0


def build_models(cfg: TrainConfig):
    """Fresh tokenizer, text encoder and transformer (weights drawn from the global torch RNG)."""
    from omni_model_shapes.models import ShapesTextEncoder, ShapesTransformer2DModel

    tokenizer = ShapesTokenizer.from_words(data.vocabulary(), max_length=cfg.max_length)
    text_encoder = ShapesTextEncoder(vocab_size=len(tokenizer), max_length=cfg.max_length, **cfg.text_encoder)
    transformer = ShapesTransformer2DModel(sample_size=cfg.image_size, text_dim=cfg.text_encoder["dim"],
                                           **cfg.transformer)
    return tokenizer, text_encoder, transformer


def make_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)


def save_model_folder(out: str, tokenizer, text_encoder, transformer, scheduler, info: dict | None = None) -> None:
    """Write the diffusers-style folder: ``model_index.json`` plus one subfolder per component."""
    import diffusers

    os.makedirs(out, exist_ok=True)
    transformer.save_pretrained(os.path.join(out, "transformer"), safe_serialization=True)
    text_encoder.save_pretrained(os.path.join(out, "text_encoder"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    scheduler.save_pretrained(os.path.join(out, "scheduler"))
    index = {
        "_class_name": "ShapesPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["omni_model_shapes", "ShapesTextEncoder"],
        "tokenizer": ["omni_model_shapes", "ShapesTokenizer"],
        "transformer": ["omni_model_shapes", "ShapesTransformer2DModel"],
    }
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    if info is not None:
        with open(os.path.join(out, "training.json"), "w") as f:
            json.dump(info, f, indent=2)


def lr_at(cfg: TrainConfig, it: int) -> float:
    if it < cfg.warmup:
        return cfg.lr * (it + 1) / cfg.warmup
    progress = (it - cfg.warmup) / max(1, cfg.iterations - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig, out: str | None = None, log=print):
    """Train; return (tokenizer, text_encoder, transformer) with the EMA weights. Saves to ``out`` if given."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer, text_encoder, transformer = build_models(cfg)
    ema = {k: v.detach().clone() for k, v in _named_state(text_encoder, transformer).items()}
    params = list(text_encoder.parameters()) + list(transformer.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    text_encoder.train()
    transformer.train()
    transformer.batch_invariant = False  # batched per-sample matmuls: faster, and training needs no invariance
    wall0, cpu0 = time.perf_counter(), time.process_time()
    running = 0.0
    for it in range(cfg.iterations):
        batch = data.make_batch(cfg.batch_size, gen, cfg.image_size, cfg.image_size, cfg.size_word_prob)
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.text_drop
        prompts = ["" if d else p for d, p in zip(drop.tolist(), batch.prompts)]
        x0 = batch.images * 2 - 1
        noise = torch.randn(x0.shape, generator=gen)
        if cfg.sigma_sampling == "logit_normal":
            sigma = torch.sigmoid(torch.randn(cfg.batch_size, generator=gen))
        else:
            sigma = torch.rand(cfg.batch_size, generator=gen)
        xt = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
        ids, mask = tokenizer(prompts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            model_out = transformer(xt, sigma * 1000, text_encoder(ids, mask), mask).float()
        pred = velocity(model_out, xt, sigma.clamp(min=cfg.sigma_floor), transformer.config.prediction_type)
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, it)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(cfg.ema_decay, (1 + it) / (10 + it))
        with torch.no_grad():
            for k, v in _named_state(text_encoder, transformer).items():
                ema[k].lerp_(v.detach(), 1 - decay)
        running += loss.item()
        if (it + 1) % cfg.log_every == 0 or it + 1 == cfg.iterations:
            n = (it % cfg.log_every) + 1
            log(f"it {it + 1}/{cfg.iterations} loss {running / n:.4f} lr {lr_at(cfg, it):.2e} "
                f"wall {time.perf_counter() - wall0:.0f}s cpu {time.process_time() - cpu0:.0f}s")
            running = 0.0
        if out and cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0 and it + 1 < cfg.iterations:
            _save_ema(cfg, os.path.join(out, f"checkpoint-{it + 1}"), tokenizer, text_encoder, transformer, ema)
    with torch.no_grad():
        for k, v in _named_state(text_encoder, transformer).items():
            v.copy_(ema[k])
    text_encoder.eval()
    transformer.eval()
    transformer.batch_invariant = True
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    log(f"trained {cfg.iterations} iterations in {wall:.0f} s wall, {cpu:.0f} s CPU ({cfg.threads} threads)")
    if out:
        info = {"config": asdict(cfg), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "torch": torch.__version__,
                "final_loss": round(loss.item(), 5)}
        save_model_folder(out, tokenizer, text_encoder, transformer, make_scheduler(), info)
        log(f"saved to {out}")
    return tokenizer, text_encoder, transformer


def _save_ema(cfg, path, tokenizer, text_encoder, transformer, ema) -> None:
    """Save the EMA weights without disturbing the training weights."""
    import copy

    te, tr = copy.deepcopy(text_encoder).eval(), copy.deepcopy(transformer).eval()
    with torch.no_grad():
        for k, v in _named_state(te, tr).items():
            v.copy_(ema[k])
    tr.batch_invariant = True
    save_model_folder(path, tokenizer, te, tr, make_scheduler())


def _named_state(text_encoder, transformer) -> dict[str, torch.Tensor]:
    out = {f"te.{k}": v for k, v in text_encoder.named_parameters()}
    out.update({f"tr.{k}": v for k, v in transformer.named_parameters()})
    return out


def default_out() -> str:
    from omni_model_shapes.weights import model_path

    return model_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_model_shapes.train", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output folder (default ./shapes-seed<SEED>); the shipped "
                        "model is src/omni_model_shapes/weights")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (the shipped weights used the "
                        "default; another count gives slightly different weights)")
    parser.add_argument("--config", default=None, help="JSON object overriding TrainConfig fields")
    args = parser.parse_args(argv)
    cfg = TrainConfig(seed=args.seed)
    overrides = json.loads(args.config) if args.config else {}
    for name in ("iterations", "batch_size", "threads"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    for name, value in overrides.items():
        if name not in TrainConfig.__dataclass_fields__:
            parser.error(f"unknown TrainConfig field {name!r}; fields: {', '.join(TrainConfig.__dataclass_fields__)}")
        setattr(cfg, name, value)
    out = args.out or os.path.join(os.getcwd(), f"shapes-seed{args.seed}")
    for name in ("transformer", "text_encoder", "tokenizer", "scheduler"):
        # replace an earlier model in place (the shipped folder is also a package: keep its __init__.py)
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    train(cfg, out, log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
