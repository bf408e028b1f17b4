"""Engine outputs as the images clients get: PIL conversion, PNG/base64 encoding, preview thumbnails."""

from __future__ import annotations

import base64
import io
from typing import Any


def png_b64(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def preview_image(tensor: Any, max_side: int) -> Any:
    from omni_core.images import tensor_to_pil

    image = tensor_to_pil(tensor)
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side))
    return image


def pil_outputs(out: Any) -> list:
    """The output's images as PIL (a list of frames per video). The server asks the engine for tensors
    (``output_type="pt"``) and converts them itself, so a client gets the model's pixels at the ``size`` it
    asked for (a plugin's display tweaks for PIL output, such as upscaling, do not apply)."""
    from omni_core.images import tensor_to_pil

    return [im if not hasattr(im, "dim") else tensor_to_pil(im) for im in (out.images or [])]


def size_of(image: Any) -> str:
    if isinstance(image, list):  # video frames
        image = image[0]
    return f"{image.width}x{image.height}"


def mp4_bytes(frames: Any, fps: int, audio: Any = None, sample_rate: int | None = None) -> bytes:
    """One video (a list of PIL frames, with its sound track if the model made one) as MP4 bytes, written by
    ``omni_core.utils.media.write_video``."""
    import os
    import tempfile

    from omni_core.utils.media import write_video

    frames = frames if isinstance(frames, list) else [frames]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        write_video(frames, path, fps, audio=audio, sample_rate=sample_rate)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.remove(path)
