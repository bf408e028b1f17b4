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


#: the sound track's codec per container: lossless where the container allows it (FLAC in MP4 plays in every
#: current browser; PCM in QuickTime), Opus in WebM (the only codecs WebM takes are lossy)
AUDIO_CODECS = {".mp4": "flac", ".mov": "pcm_s16le", ".webm": "libopus"}
#: the picture's codec per container (WebM takes only VP8/VP9/AV1: with H.264 ffmpeg wrote nothing, silently)
VIDEO_CODECS = {".mp4": "libx264", ".mov": "libx264", ".webm": "libvpx-vp9"}


def write_video(frames: Sequence[Any], path: str, fps: int = 16, audio: Any = None,
                sample_rate: int | None = None) -> str:
    """Write PIL frames to ``path`` (``.mp4``/``.webm``/``.mov`` through imageio-ffmpeg, ``.gif`` through PIL),
    with ``audio`` (``[channels, samples]`` float in [-1, 1] at ``sample_rate`` Hz: a model's sound track) muxed in
    as a second stream (:data:`AUDIO_CODECS`)."""
    if not frames:
        raise ValueError("no frames to write")
    suffix = os.path.splitext(path)[1].lower()
    if audio is not None and suffix not in AUDIO_CODECS:
        raise ValueError(f"{path}: a {suffix or 'suffix-less'} file cannot carry the sound track; "
                         f"write one of {', '.join(AUDIO_CODECS)}")
    if suffix == ".gif":
        frames[0].save(path, save_all=True, append_images=list(frames[1:]), duration=int(1000 / fps), loop=0)
        return path
    import tempfile

    import imageio.v2 as imageio
    import numpy as np

    # H.264 wants even sizes; pad by replicating the last row/column
    arrays = []
    for f in frames:
        a = np.asarray(f.convert("RGB"))
        h, w = a.shape[:2]
        arrays.append(np.pad(a, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge"))
    with tempfile.TemporaryDirectory(prefix="omni-audio-") as tmp:
        sound = {}
        if audio is not None:
            sound = {"audio_path": write_wav(audio, sample_rate, os.path.join(tmp, "track.wav")),
                     "audio_codec": AUDIO_CODECS[suffix]}
        with imageio.get_writer(path, fps=fps, codec=VIDEO_CODECS[suffix], macro_block_size=1, **sound) as writer:
            for a in arrays:
                writer.append_data(a)
    if not os.path.exists(path) or os.path.getsize(path) == 0:  # ffmpeg reports some failures only on stderr
        raise RuntimeError(f"{path}: ffmpeg wrote no video (see its messages above)")
    return path


def write_wav(audio: Any, sample_rate: int | None, path: str) -> str:
    """``audio`` (``[channels, samples]`` or ``[samples]``, float in [-1, 1]) as 16-bit PCM WAV: what ffmpeg reads
    to mux a sound track (16 bits keep a sample within 1/32768 of the float one)."""
    import wave

    import numpy as np

    if not sample_rate or int(sample_rate) <= 0:
        raise ValueError(f"sample_rate: a sound track needs its rate in Hz (got {sample_rate!r})")
    data = audio.detach().float().cpu().numpy() if hasattr(audio, "detach") else np.asarray(audio, dtype=np.float32)
    if data.ndim == 1:
        data = data[None]
    if data.ndim != 2 or data.shape[0] > 8 or data.shape[1] == 0:
        raise ValueError(f"audio: expected [channels, samples] with at most 8 channels, got shape {data.shape}")
    pcm = np.clip(np.round(data.T * 32768.0), -32768, 32767).astype("<i2")  # what decoders divide by 32768
    with wave.open(path, "wb") as w:
        w.setnchannels(data.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.tobytes())
    return path
