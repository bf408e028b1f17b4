"""The VAE decode split across ranks (issue #39): peak decode memory and wall time per rank, next to one process.

    .venv/bin/python bench/parallel_decode.py [--only image,video] [--size 1024] [--video-size 256] [--frames 33]
                                              [--rounds 3]
    .venv/bin/python bench/parallel.py --decode ...       # the same

VAEs (random weights, built from configs as diffusers' tests do): ``image`` is ``AutoencoderKL`` with four
blocks (16, 32, 64, 64 channels, so 8x spatial compression) decoding a ``--size`` square with diffusers' tiling
(512-pixel tiles, a quarter overlap); ``video`` is ``AutoencoderKLWan`` (``base_dim`` 16) decoding ``--frames``
frames of ``--video-size`` pixels with 128-pixel tiles, stride 96. Rows, all in two gloo processes spawned with
``omni_core.distributed.spawn_workers`` (``ParallelConfig(cfg_parallel_size=2)``, so ``decode_group()`` is the
world): ``plain`` is ``vae.decode`` with tiling off on rank 0 alone (what one process does by default; the
engine splits and so tiles every decode of at least ``SPLIT_PIXELS`` when several ranks hold the latents),
``tiled`` is ``vae.decode`` with tiling on (diffusers' ``tiled_decode`` once the latents exceed one tile) on rank
0 alone, ``split`` is ``parallel_tiled_decode`` on both ranks.
Wall time: median over ``--rounds`` rotated rounds (barrier to barrier on rank 0; one process runs with all
cores' threads, each of the two ranks with half). Max |diff| is against the one-process tiled decode.

Memory: the peak of the bytes held by tensors created during the decode, tracked by a ``TorchDispatchMode``
that adds each new CPU storage's size when an op returns it and subtracts it when the storage is freed (a
weakref callback on the storage). Why this and not the process RSS: it counts exactly the decode's tensors
(activations, tiles, the output; not the weights or the latents, which exist before), does not depend on
what glibc's allocator keeps or returns, and so gives one deterministic figure per process for runs that
share a process with other variants. It does not count the allocator's own overhead or a kernel's scratch
buffers (e.g. im2col inside a convolution), which are the same for the compared rows at equal tile size.
Shapes the split decode computes on ``meta`` (other ranks' tiles, pass 1) hold no memory and are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import weakref

ROWS = ("plain", "tiled", "split")


class LiveBytes:
    """Peak bytes of storages created under it (see the module docstring); ``with LiveBytes() as m: ...; m.peak``."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer._record(out)
                return out

        self.mode = Mode()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _record(self, out) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self._refs:
                continue
            self.live += size
            self.peak = max(self.peak, self.live)
            self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._refs.pop(key, None)

    def __enter__(self) -> LiveBytes:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


def _vae(kind: str, args: dict):
    """(vae with tiling set, measured latents, warm-up latents)."""
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLWan

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32, 64, 64),
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            layers_per_block=1, norm_num_groups=8).eval()
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor = 512, 64, 0.25
        side = args["size"] // 8
        return vae, torch.randn(1, 4, side, side, generator=g), torch.randn(1, 4, 16, 16, generator=g)
    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    tile = args["video_tile"]
    vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_sample_stride_height=tile * 3 // 4,
                      tile_sample_stride_width=tile * 3 // 4)
    side, frames = args["video_size"] // 8, (args["frames"] - 1) // 4 + 1
    return (vae, torch.randn(1, 16, frames, side, side, generator=g),
            torch.randn(1, 16, 2, 16, 16, generator=g))


def run(rank: int, world_size: int, kind: str, args: dict) -> dict:
    """Every rank: warm up, time the rows in rotated rounds, then one memory-tracked decode per row."""
    import torch

    from omni_core.config import ParallelConfig
    from omni_core.distributed import get_world_group, init_parallel_state
    from omni_core.distributed.parallel_decode import decode_group, parallel_tiled_decode

    init_parallel_state(ParallelConfig(cfg_parallel_size=2))
    world, group = get_world_group(), decode_group()
    vae, latents, small = _vae(kind, args)
    cores = args["cores"]

    def plain(z):
        vae.use_tiling = False
        try:
            return vae.decode(z, return_dict=False)[0]
        finally:
            vae.use_tiling = True

    def decode(row: str, z, track: bool = False):
        """(seconds barrier to barrier, output or None, peak bytes or None) of one row's decode."""
        torch.set_num_threads(cores if row != "split" else max(1, cores // world_size))
        world.barrier()
        start, out, meter = time.perf_counter(), None, LiveBytes() if track else None
        if row == "split" or rank == 0:
            with meter or contextlib.nullcontext():
                if row == "plain":
                    out = plain(z)
                elif row == "tiled":  # vae.tiled_decode when the latents exceed one tile (diffusers' rule)
                    out = vae.decode(z, return_dict=False)[0]
                else:
                    out = parallel_tiled_decode(vae, z, group)
        world.barrier()
        return time.perf_counter() - start, out, meter.peak if meter and out is not None else None

    times: dict[str, list[float]] = {r: [] for r in ROWS}
    with torch.no_grad():
        for row in ROWS:
            decode(row, small)
        for r in range(args["rounds"]):
            for row in ROWS[r % 3:] + ROWS[:r % 3]:
                times[row].append(decode(row, latents)[0])
        peaks, outs = {}, {}
        for row in ROWS:
            _, outs[row], peaks[row] = decode(row, latents, track=True)
    result = {"times": times, "peaks": peaks, "output_bytes": outs["split"].nbytes,
              "shape": tuple(outs["split"].shape)}
    if rank == 0:
        result["diff"] = {row: float((outs[row] - outs["tiled"]).abs().max()) for row in ROWS}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="image,video", help="comma-separated: image, video")
    parser.add_argument("--size", type=int, default=1024, help="image: output height = width")
    parser.add_argument("--video-size", type=int, default=384, help="video: output height = width")
    parser.add_argument("--frames", type=int, default=17, help="video: output frames (4k + 1)")
    parser.add_argument("--video-tile", type=int, default=256, help="video: tile size (stride 3/4 of it)")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args(argv)

    import torch

    from omni_core.distributed import spawn_workers

    cores = os.cpu_count() or 1
    args = {"size": opts.size, "video_size": opts.video_size, "frames": opts.frames, "video_tile": opts.video_tile,
            "rounds": opts.rounds,
            "cores": cores}
    print(f"fp32, torch {torch.__version__}, {cores} CPU cores, gloo, 2 ranks, {opts.rounds} rotated rounds")
    print(f"{'VAE':<22}{'output':>18}{'row':>7}{'peak MB r0':>12}{'peak MB r1':>12}{'vs tiled':>10}"
          f"{'vs plain':>10}{'s (median)':>12}{'vs tiled':>10}{'max |diff|':>12}{'load':>12}")
    for kind in [k for k in ("image", "video") if k in opts.only.split(",")]:
        load = os.getloadavg()[0]
        res = spawn_workers(f"{__file__}:run", 2, (kind, args), timeout=900, threads=max(1, cores // 2))
        load = f"{load:.2f}/{os.getloadavg()[0]:.2f}"
        name = "AutoencoderKL" if kind == "image" else "AutoencoderKLWan"
        shape = "x".join(str(s) for s in res[0]["shape"][2:])
        peaks = [r["peaks"] for r in res]
        med = {row: statistics.median(res[0]["times"][row] or [float("nan")]) for row in ROWS}  # --rounds 0: memory only
        for row in ROWS:
            r1 = peaks[1][row]
            worst = max(p for p in (peaks[0][row], r1) if p is not None)
            print(f"{name:<22}{shape:>18}{row:>7}{peaks[0][row] / 1e6:>12.1f}"
                  f"{(f'{r1 / 1e6:.1f}' if r1 is not None else '-'):>12}{worst / peaks[0]['tiled']:>9.2f}x"
                  f"{worst / peaks[0]['plain']:>9.2f}x{med[row]:>12.2f}{med[row] / med['tiled']:>9.2f}x"
                  f"{res[0]['diff'][row]:>12.2e}{load:>12}")
        print(f"{'':<22}{'':>18}  output tensor {res[0]['output_bytes'] / 1e6:.1f} MB (held by every row's process)")


if __name__ == "__main__":
    sys.exit(main())
