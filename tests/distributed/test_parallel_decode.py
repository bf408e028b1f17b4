"""A VAE decode split across two gloo ranks (issue #39) equals the one-process tiled decode, for an image VAE
(diffusers' ``AutoencoderKL``) and a causal video VAE (``AutoencoderKLWan``), and each rank decodes only its tiles."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist


def _vae(kind: str):
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLWan

    torch.manual_seed(0)
    if kind == "image":
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                            norm_num_groups=4).eval()
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor = 32, 16, 0.25
        latents = torch.randn(2, 4, 40, 56)  # 3 x 4 tiles of 16 latents with a stride of 12
    else:
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True]).eval()
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                          tile_sample_stride_width=24)
        latents = torch.randn(1, 16, 3, 10, 7)  # 3 latent frames (9 video frames), 80x56 pixels: 2 x 4 tiles
    return vae, latents


def _rank(rank: int, world_size: int, kind: str) -> dict:
    import torch

    from omni_core.config import ParallelConfig
    from omni_core.distributed import init_parallel_state
    from omni_core.distributed.parallel_decode import decode_group, parallel_tiled_decode, vae_decode

    init_parallel_state(ParallelConfig(cfg_parallel_size=2))
    vae, latents = _vae(kind)
    with torch.no_grad():
        reference = vae.tiled_decode(latents, return_dict=False)[0]  # diffusers, this process alone
    stats: dict = {}
    split = parallel_tiled_decode(vae, latents, decode_group(), stats=stats)
    automatic = vae_decode(vae, latents)  # tiling is on: the pipeline's decode call splits too
    return {"diff": (split - reference).abs().max().item(), "auto_diff": (automatic - reference).abs().max().item(),
            "shape": tuple(split.shape), **stats}


@pytest.mark.parametrize("kind", ["image", "video"])
def test_split_decode_equals_the_one_process_tiled_decode(kind):
    from omni_core.distributed import spawn_workers

    results = spawn_workers(f"{__file__}:_rank", 2, (kind,), timeout=240)
    for rank, result in enumerate(results):
        assert result["diff"] <= 1e-5 and result["auto_diff"] <= 1e-5, (rank, result)
    assert results[0]["shape"] == results[1]["shape"]
    # the tiles were dealt: each rank computed about half of the decoder calls, together all of them
    calls = results[0]["decoder_calls"]
    assert results[0]["tiles"] >= 6 and calls == results[1]["decoder_calls"], results
    assert sum(r["computed_calls"] for r in results) == calls, results
    assert all(0 < r["computed_calls"] <= calls // 2 + 3 for r in results), results


def _failing_rank(rank: int, world_size: int) -> str:
    import time

    import torch

    from omni_core.config import ParallelConfig
    from omni_core.distributed import init_parallel_state
    from omni_core.distributed.parallel_decode import decode_group, parallel_tiled_decode

    init_parallel_state(ParallelConfig(cfg_parallel_size=2))
    vae, latents = _vae("image")
    if rank == 1:  # its share of the tiles fails (an out-of-memory, say)
        def fail(module, args):
            if args[0].device.type != "meta":
                raise torch.OutOfMemoryError("test: rank 1's tile")
        vae.decoder.register_forward_pre_hook(fail)
    t = time.monotonic()
    try:
        parallel_tiled_decode(vae, latents, decode_group())
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc} after {time.monotonic() - t:.1f} s"
    return "no error"


def test_a_rank_that_fails_its_tiles_fails_the_decode_on_every_rank_at_once():
    from omni_core.distributed import spawn_workers

    results = spawn_workers(f"{__file__}:_failing_rank", 2, (), timeout=120)
    assert results[1].startswith("OutOfMemoryError: test: rank 1's tile"), results
    assert results[0].startswith("RuntimeError: a peer rank failed its share of the parallel VAE decode"), results
    assert all(float(r.split(" after ")[1].split()[0]) < 30 for r in results), results  # no collective timeout
