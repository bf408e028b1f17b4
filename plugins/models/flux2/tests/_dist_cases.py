"""Worker of ``test_parallel.py`` (run by ``spawn_workers`` in two gloo processes): per parallel config the tiny
[klein] folder loaded through the real loader after ``init_parallel_state`` (so the core installs the spec's SP
plan, or splits the transformer by its TP plan, each rank reading only its shard), one request batch, each output
against the same batch in one process (loaded before any group exists), and the share of the transformer's
parameter bytes the rank holds."""

from __future__ import annotations

import numpy as np
import torch

NEG = "blurry, low quality"
#: (prompt, negative, guidance, height, width, reference image side or 0): CFG on and off; 6x10 is 3 x 5 = 15
#: image tokens (odd: the plan pads and strips); one request with a 64x64 reference image (1024 more tokens)
REQUESTS = [("a red fox jumps over a lazy dog", NEG, 4.0, 6, 10, 0), ("a cat", None, 3.0, 6, 10, 0),
            ("two ships", None, 1.0, 6, 10, 0), ("an astronaut", NEG, 4.0, 8, 8, 64)]


def run(pipeline) -> list[torch.Tensor]:
    from PIL import Image

    from omni_core.testing import make_state

    rng = np.random.default_rng(0)
    states = []
    for i, (prompt, negative, scale, h, w, ref) in enumerate(REQUESTS):
        images = [Image.fromarray(rng.integers(0, 256, (ref, ref, 3), dtype=np.uint8))] if ref else []
        states.append(make_state(pipeline, prompt, seed=i, negative_prompt=negative, guidance_scale=scale, height=h,
                                 width=w, num_inference_steps=2, max_sequence_length=64, images=images))
    return [out.tensor for out in pipeline.forward(states)]


def worker(rank: int, world_size: int, folder: str, configs: list[dict]) -> list[tuple]:
    from omni_core.config import ParallelConfig
    from omni_core.distributed.parallel_state import (communication_stats, destroy_parallel_state,
                                                      init_parallel_state, reset_communication_stats)
    from omni_core.distributed.sharded_load import parameter_bytes
    from omni_core.testing import load_model

    plain = load_model(folder)
    ref = run(plain)
    full_bytes = parameter_bytes(plain.transformer)
    rows = []
    for cfg in configs:
        pc = ParallelConfig.from_kwargs(**cfg)
        init_parallel_state(pc)
        try:
            pipeline = load_model(folder, parallel_config=pc)
            reset_communication_stats()
            outs = run(pipeline)
            sent = communication_stats()["total"]
            held = parameter_bytes(pipeline.transformer) / full_bytes
        finally:
            destroy_parallel_state()
        label = ", ".join(f"{k}={v}" for k, v in cfg.items())
        rows.append((label, max(float((o - r).abs().max()) for o, r in zip(outs, ref)), float(sent), held))
    return rows
