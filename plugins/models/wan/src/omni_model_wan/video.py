"""Write video frames to MP4 with imageio + imageio-ffmpeg (no ``omni_core`` import, usable anywhere)."""

from __future__ import annotations

import os
from typing import Any, Sequence


def _to_uint8_frames(frames: Any) -> list:
    """PIL images, HxWx3 uint8/float arrays, or a ``[F, 3, H, W]`` float tensor in [0, 1] -> HxWx3 uint8 arrays."""
    import numpy as np

    if hasattr(frames, "detach"):  # torch tensor [F, 3, H, W] in [0, 1]
        arr = (frames.detach().float().clamp(0, 1) * 255).round().to("cpu").numpy().astype(np.uint8)
        return list(arr.transpose(0, 2, 3, 1))
    out = []
    for f in frames:
        a = np.asarray(f)
        if a.dtype != np.uint8:
            a = (np.clip(a.astype(np.float32), 0, 1) * 255).round().astype(np.uint8)
        if a.ndim == 2:
            a = np.stack([a] * 3, axis=-1)
        out.append(a[..., :3])
    return out


def write_mp4(frames: Sequence[Any] | Any, path: str | os.PathLike, fps: int = 16) -> str:
    """Encode ``frames`` (see :func:`_to_uint8_frames`) as H.264 MP4 at ``fps``; returns the path.

    Frame sizes that are not multiples of 16 are padded by ffmpeg's macro-block rule (imageio warns).
    """
    import imageio.v2 as imageio

    arrays = _to_uint8_frames(frames)
    if not arrays:
        raise ValueError("write_mp4 needs at least one frame")
    path = os.fspath(path)
    with imageio.get_writer(path, fps=fps, codec="libx264", format="FFMPEG", pixelformat="yuv420p") as writer:
        for a in arrays:
            writer.append_data(a)
    return path
