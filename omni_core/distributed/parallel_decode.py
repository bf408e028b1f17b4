"""A VAE decode split across ranks: each rank decodes its share of diffusers' tiles, the tiles are exchanged, and
diffusers' own blending runs on all of them, so the result is exactly the one-process tiled decode.

Why: after a sequence-, tensor- or CFG-parallel denoise every rank of a replica holds the same final latents and
used to decode them all, each alone, so the decode (which for a long video or a large image needs more memory
than the denoiser's step) neither got faster nor smaller with more ranks. xDiT splits it (patch-parallel decode);
here the split reuses diffusers' ``tiled_decode`` as it is, in two passes, through a hook on ``vae.decoder``:

1. *decode*: ``vae.decode`` runs with tiling; a decoder call of a tile this rank owns (tiles dealt round-robin)
   computes, a call of another rank's tile runs on the ``meta`` device (``torch.func.functional_call`` with the
   decoder's weights as meta tensors: shapes only, no compute, no memory) and returns zeros of that shape, so
   diffusers' loop and blending run on (partly empty) tiles;
2. *exchange*: each call's output is broadcast by its owner (shapes are known to all from pass 1);
3. *replay*: ``vae.decode`` runs again with every decoder call answered from the exchanged outputs: diffusers'
   blending now sees every tile, and the output is the one-process tiled decode, on every rank.

A tile is one decoder call for image VAEs, and for causal video VAEs (Wan, Qwen-Image: a ``feat_cache`` carried
frame to frame) the calls from one ``clear_cache`` (all cache entries ``None``) to the next, so a tile's frames
stay on one rank. Used automatically (:func:`vae_decode`) when several ranks hold the same latents and the VAE
tiles: tiling is on, or the decode has at least :data:`SPLIT_PIXELS` pixel-frames per sample.

What it saves, measured (``bench/parallel_decode.py``, ``docs/benchmarks.md``): time, each rank decoding about
half the tiles (0.87-0.94x the one-process tiled decode on two shared CPU cores), and memory only against the
untiled decode one process runs by default (a rank's peak 0.29-0.71x of it: the split tiles large decodes).
Against the one-process *tiled* decode a rank's peak is 1.00-1.17x: it decodes whole tiles of the same size and
also holds every tile and the whole output, so a split by tiles cannot lower the peak below one tile's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from omni_core.hooks import FunctionHook, STAGES, add_hook, remove_hook

#: decodes at least this large (output pixel-frames per sample) are tiled and split whenever several ranks hold
#: the same latents, even if the user did not turn tiling on: a 1024x1024 image, or 16 frames of 480x832
SPLIT_PIXELS = 1024 * 1024
HOOK = "omni.parallel_decode"


def _tile_start(kwargs: dict) -> bool:
    cache = kwargs.get("feat_cache")
    return cache is None or all(entry is None for entry in cache)


class _Split:
    """Pass 1: decode owned tiles, shapes of the others (on meta)."""

    def __init__(self, decoder: Any, rank: int, world: int) -> None:
        self.decoder, self.rank, self.world = decoder, rank, world
        self.shaping = False
        self.meta_state: dict | None = None
        self.tile = -1
        self.owner: list[int] = []
        self.outputs: dict[int, torch.Tensor] = {}
        self.shapes: list[tuple[tuple[int, ...], torch.dtype, torch.device]] = []

    def __call__(self, below: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.shaping:  # the meta call of another rank's tile, come back through this hook
            return below(*args, **kwargs)
        if _tile_start(kwargs):
            self.tile += 1
        owner = self.tile % self.world
        call = len(self.owner)
        self.owner.append(owner)
        if owner == self.rank:
            out = below(*args, **kwargs)
            self.outputs[call] = out.clone()  # diffusers' blend_v / blend_h write into the tiles they blend
            self.shapes.append((tuple(out.shape), out.dtype, out.device))
            return out
        device = args[0].device if args and torch.is_tensor(args[0]) else torch.device("cpu")
        shape = self._shape_of(args, kwargs)
        self.shapes.append((tuple(shape.shape), shape.dtype, device))
        return torch.zeros(shape.shape, dtype=shape.dtype, device=device)

    def _shape_of(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The decoder's output for these inputs, on ``meta``. A causal VAE's ``feat_cache`` list is passed as it is:
        the decoder fills it with meta tensors for this tile's later frames (the next tile starts from a cleared
        cache)."""
        if self.meta_state is None:
            self.meta_state = {name: t.to("meta") for name, t in
                               [*self.decoder.named_parameters(), *self.decoder.named_buffers()]}
        meta = lambda x: x.to("meta") if torch.is_tensor(x) else x  # noqa: E731
        self.shaping = True
        try:
            return torch.func.functional_call(self.decoder, self.meta_state, tuple(meta(a) for a in args),
                                              {k: meta(v) for k, v in kwargs.items()})
        finally:
            self.shaping = False


class _Replay:
    """Pass 3: every decoder call answered from the exchanged outputs."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self.outputs = outputs
        self.call = 0

    def __call__(self, below: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.outputs[self.call]
        self.outputs[self.call] = None  # diffusers holds what it keeps (a video tile's frames: until their cat)
        self.call += 1
        return out


@contextlib.contextmanager
def _decoder_hook(vae: Any, fn: Any):
    add_hook(vae.decoder, HOOK, FunctionHook(fn, order=STAGES["kernel"]))
    try:
        yield
    finally:
        remove_hook(vae.decoder, HOOK)


@contextlib.contextmanager
def _tiling(vae: Any):
    was = vae.use_tiling
    vae.use_tiling = True
    try:
        yield
    finally:
        vae.use_tiling = was


def parallel_tiled_decode(vae: Any, latents: torch.Tensor, group: Any, *, stats: dict | None = None,
                          **decode_kwargs: Any) -> torch.Tensor:
    """``vae.decode(latents)`` with tiling, its tiles decoded across ``group`` (a GroupCoordinator whose ranks all
    call this with the same latents); every rank returns the whole decode, equal to the one-process tiled one.
    ``stats`` (a dict) receives ``tiles``, ``decoder_calls`` and ``computed_calls`` (this rank's)."""
    split = _Split(vae.decoder, group.rank_in_group, group.world_size)
    with _tiling(vae), torch.no_grad():
        failed: BaseException | None = None
        try:
            with _decoder_hook(vae, split):
                vae.decode(latents, return_dict=False, **decode_kwargs)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            failed = exc
        # every rank learns whether all decoded their share before any waits for a tile (a rank that raised
        # would otherwise leave its peers blocked in the exchange until the collective timeout)
        flag = group.all_reduce(torch.tensor([0 if failed is None else 1], device=latents.device))
        if failed is not None:
            raise failed
        if int(flag.item()):
            raise RuntimeError("a peer rank failed its share of the parallel VAE decode")
        exchanged = []
        for call, (shape, dtype, device) in enumerate(split.shapes):
            tensor = split.outputs.get(call)
            if tensor is None:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            exchanged.append(group.broadcast(tensor.contiguous(), src=split.owner[call]))
        if stats is not None:
            stats.update(tiles=split.tile + 1, decoder_calls=len(split.owner),
                         computed_calls=sum(o == split.rank for o in split.owner))
        split.outputs.clear()
        with _decoder_hook(vae, _Replay(exchanged)):
            return vae.decode(latents, return_dict=False, **decode_kwargs)[0]


def _decode_pixels(vae: Any, latents: torch.Tensor) -> int:
    factor = getattr(vae, "spatial_compression_ratio", None)
    if factor is None:
        factor = 2 ** (len(getattr(vae.config, "block_out_channels", (0,))) - 1)
    frames = latents.shape[2] if latents.dim() == 5 else 1
    return int(latents.shape[-1] * latents.shape[-2] * factor * factor * frames)


def decode_group() -> Any:
    """The ranks that hold the same latents at decode time: the whole world when there is one data-parallel
    replica; None otherwise (the replica has no group of its own yet) or for one process."""
    from omni_core.distributed.parallel_state import get_dp_group, get_world_group

    world = get_world_group()
    if world.world_size == 1 or get_dp_group().world_size > 1:
        return None
    return world


def vae_decode(vae: Any, latents: torch.Tensor, **decode_kwargs: Any) -> torch.Tensor:
    """What a pipeline calls instead of ``vae.decode(latents, return_dict=False)[0]``: the decode split across the
    ranks that hold these latents when the VAE tiles and it is worth it (see the module docstring), else the
    plain decode."""
    group = decode_group()
    if (group is not None and hasattr(vae, "tiled_decode") and hasattr(vae, "decoder")
            and (getattr(vae, "use_tiling", False) or _decode_pixels(vae, latents) >= SPLIT_PIXELS)):
        return parallel_tiled_decode(vae, latents, group, **decode_kwargs)
    return vae.decode(latents, return_dict=False, **decode_kwargs)[0]


__all__ = ["SPLIT_PIXELS", "decode_group", "parallel_tiled_decode", "vae_decode"]
