"""Writing generated images and videos to files."""

from __future__ import annotations

import os
from typing import Any, Sequence

VIDEO_SUFFIXES = (".mp4", ".gif", ".webm", ".mov")


def upscale_for_display(image: Any, min_side: int = 256) -> Any:
    """Nearest-neighbour upscale of a small PIL image so its shorter side is at least ``min_side``."""
    from PIL import Image

    factor = -(-min_side // min(image.size))
    if factor <= 1:
        return image
    return image.resize((image.width * factor, image.height * factor), Image.NEAREST)


def write_video(frames: Sequence[Any], path: str, fps: int = 16) -> str:
    """Write PIL frames to ``path`` (``.mp4``/``.webm``/``.mov`` through imageio-ffmpeg, ``.gif`` through PIL)."""
    if not frames:
        raise ValueError("no frames to write")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".gif":
        frames[0].save(path, save_all=True, append_images=list(frames[1:]), duration=int(1000 / fps), loop=0)
        return path
    import imageio.v2 as imageio
    import numpy as np

    # H.264 wants even sizes; pad by replicating the last row/column
    arrays = []
    for f in frames:
        a = np.asarray(f.convert("RGB"))
        h, w = a.shape[:2]
        arrays.append(np.pad(a, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge"))
    with imageio.get_writer(path, fps=fps, macro_block_size=1) as writer:
        for a in arrays:
            writer.append_data(a)
    return path
