"""Video files as a player reads them: every container ``write_video`` accepts holds the frames, and a model's
sound track (LTX-2's) rides along as a second stream of the video's duration, read back with PyAV (FFmpeg's own
demuxer and decoders) equal to the samples written within 16-bit rounding."""

from __future__ import annotations

import numpy as np
import pytest

av = pytest.importorskip("av")

FPS, FRAMES, RATE = 8, 9, 16000


@pytest.fixture(scope="module")
def frames():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (30, 46, 3), dtype=np.uint8)) for _ in range(FRAMES)]


@pytest.fixture(scope="module")
def sound():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.rand(2, RATE * FRAMES // FPS, generator=g) * 2 - 1  # stereo, as long as the video


def read(path: str) -> tuple[dict, np.ndarray | None, int | None]:
    """The container's streams (type -> codec), its decoded audio ``[channels, samples]`` in [-1, 1], its rate."""
    with av.open(path) as container:
        streams = {s.type: s.codec_context.name for s in container.streams}
        n_video = sum(1 for _ in container.decode(video=0))
    audio, rate = None, None
    if "audio" in streams:
        with av.open(path) as container:
            stream = container.streams.audio[0]
            rate, channels = stream.rate, stream.codec_context.channels
            chunks = []
            for frame in container.decode(stream):
                a = frame.to_ndarray()
                if frame.format.is_planar:
                    chunks.append(a)
                else:  # packed: one row of interleaved samples
                    chunks.append(a.reshape(-1, channels).T)
            audio = np.concatenate(chunks, axis=-1)
            if audio.dtype.kind == "i":
                audio = audio.astype(np.float32) / 32768.0
    return {**streams, "frames": n_video}, audio, rate


@pytest.mark.parametrize("suffix, video, audio_codec", [(".mp4", "h264", "flac"), (".mov", "h264", "pcm_s16le")])
def test_the_sound_track_is_muxed_losslessly_and_lasts_as_long_as_the_video(tmp_path, frames, sound, suffix, video,
                                                                             audio_codec):
    from omni_core.utils.media import write_video

    path = write_video(frames, str(tmp_path / f"clip{suffix}"), fps=FPS, audio=sound, sample_rate=RATE)
    streams, audio, rate = read(path)
    assert streams == {"video": video, "audio": audio_codec, "frames": FRAMES}
    assert rate == RATE and audio.shape == tuple(sound.shape)  # the requested duration: FRAMES / FPS seconds
    assert float(np.abs(audio - sound.numpy()).max()) <= 1 / 32768 + 1e-7


def test_webm_holds_vp9_and_an_opus_track(tmp_path, frames, sound):
    """WebM takes only VP8/VP9/AV1 and Vorbis/Opus (with H.264 ffmpeg wrote nothing, silently)."""
    from omni_core.utils.media import write_video

    streams, audio, rate = read(write_video(frames, str(tmp_path / "clip.webm"), fps=FPS))
    assert streams == {"video": "vp9", "frames": FRAMES}
    streams, audio, rate = read(write_video(frames, str(tmp_path / "talk.webm"), fps=FPS, audio=sound,
                                            sample_rate=RATE))
    assert streams["audio"] == "opus" and streams["frames"] == FRAMES
    assert abs(audio.shape[-1] / rate - FRAMES / FPS) < 0.05  # lossy, resampled to 48 kHz: the duration holds


@pytest.mark.parametrize("kwargs, message", [
    ({"suffix": ".gif"}, "a .gif file cannot carry the sound track; write one of .mp4, .mov, .webm"),
    ({"sample_rate": None}, "sample_rate: a sound track needs its rate in Hz"),
    ({"audio": np.zeros((2, 3, 4), np.float32)}, "audio: expected [channels, samples]"),
])
def test_a_sound_track_that_cannot_be_written_is_refused_naming_why(tmp_path, frames, sound, kwargs, message):
    from omni_core.utils.media import write_video

    path = str(tmp_path / f"clip{kwargs.get('suffix', '.mp4')}")
    with pytest.raises(ValueError) as err:
        write_video(frames, path, fps=FPS, audio=kwargs.get("audio", sound), sample_rate=kwargs.get("sample_rate", RATE))
    assert message in str(err.value)
