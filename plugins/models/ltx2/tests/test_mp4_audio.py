"""End to end: ``omni generate`` on the tiny LTX-2 folder writes an MP4 whose audio stream, read back with the
container's own reader (PyAV), lasts the requested duration (num_frames / frame_rate, within one video frame: the
causal audio VAE decodes 4 L - 3 mel frames from L latent frames, as diffusers does) and equals diffusers' waveform
for the same seed within one level of 255 and within 16-bit quantization (the file holds 16-bit samples,
losslessly: FLAC in MP4).

The CLI runs on the session's shared engine (``ltx2_engines``): its ``Omni(...)`` is answered by that started
engine after checking it asks for the same folder and nothing the engine was not started with (starting engines
is what the contract's tests pay for once)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

FRAMES, RATE, SEED = 9, 25.0, 4


def video_stream(path: str) -> tuple[int, float]:
    """(frames, frames per second) of a file's video stream, with PyAV."""
    import av

    with av.open(path) as container:
        rate = float(container.streams.video[0].average_rate)
        return sum(1 for _ in container.decode(video=0)), rate


def read_audio(path: str) -> tuple[np.ndarray, int, int]:
    """(``[channels, samples]`` float waveform, sample rate, video frames) of a file, with PyAV."""
    import av

    frames = video_stream(path)[0]
    with av.open(path) as container:
        stream = container.streams.audio[0]
        rate, channels = stream.rate, stream.codec_context.channels
        chunks = []
        for frame in container.decode(stream):
            a = frame.to_ndarray()
            chunks.append(a if frame.format.is_planar else a.reshape(-1, channels).T)
    audio = np.concatenate(chunks, axis=-1)
    if audio.dtype.kind == "i":
        audio = audio.astype(np.float32) / 32768.0
    return audio, rate, frames


@pytest.fixture
def generate(monkeypatch, ltx2_dir, ltx2_engines, capsys):
    """``generate(*flags)``: ``omni generate --model <tiny folder> ... *flags`` (in process) on the shared engine;
    returns its printed output."""
    import omni_core.entrypoints.omni as entry
    from omni_core.cli.main import main

    def shared(model, **kwargs):
        assert model == ltx2_dir
        assert kwargs.pop("warmup") is False and set(kwargs) <= {"dtype"}, f"the CLI asked for {kwargs}"
        return contextlib.nullcontext(ltx2_engines(step_execution=True))

    monkeypatch.setattr(entry, "Omni", shared)

    def run(*flags):
        rc = main(["generate", "--model", ltx2_dir, "--prompt", "a robot dancing", "--seed", str(SEED), "--steps",
                   "2", "--height", "32", "--width", "32", "--num-frames", str(FRAMES), "--no-warmup", *flags])
        assert rc == 0
        return capsys.readouterr().out

    return run


def test_omni_generate_writes_the_audio_track(generate, diffusers_ltx2, tmp_path):
    out = str(tmp_path / "clip.mp4")
    # no --fps: the file plays at the model's frame_rate (the core's PipelineSpec.fps_field)
    assert "sound" in generate("--frame-rate", str(RATE), "--out", out)
    audio, rate, frames = read_audio(out)
    assert video_stream(out)[1] == RATE
    ref = diffusers_ltx2(prompt="a robot dancing", num_inference_steps=2, height=32, width=32, num_frames=FRAMES,
                         frame_rate=RATE, output_type="pt",
                         generator=torch.Generator("cpu").manual_seed(SEED)).audio[0]
    assert frames == FRAMES
    assert rate == diffusers_ltx2.vocoder.config.output_sampling_rate
    assert audio.shape == tuple(ref.shape), f"file audio {audio.shape}, diffusers {tuple(ref.shape)}"
    assert abs(audio.shape[-1] / rate - FRAMES / RATE) <= 1 / RATE
    levels = np.abs(np.round((audio + 1) / 2 * 255) - np.round((ref.numpy() + 1) / 2 * 255)).max()
    assert levels <= 1, f"the file's audio is {levels} levels of 255 from diffusers'"
    # and within 16-bit quantization (the tiny waveform moves ~1e-3 with another seed: that is far outside)
    assert np.abs(audio - ref.numpy()).max() <= 2 / 32768
    assert np.abs(audio).max() > 1e-3  # a real track, not silence


@pytest.mark.parametrize(("flags", "fps"), [((), 24.0), (("--fps", "12"), 12.0)], ids=["default", "fps-12"])
def test_the_file_plays_at_the_frame_rate_and_fps_sets_it(generate, diffusers_ltx2, tmp_path, flags, fps):
    """Without ``--fps`` the file is written at ``frame_rate``'s default (24), with ``--fps 12`` frame_rate is 12
    (the audio track follows it) and the file is written at it: either way the audio stream lasts as long as the
    video stream, both read back with PyAV (within one video frame and the 3 mel frames the causal audio VAE
    drops, as diffusers). Before the core's ``fps_field`` the file played at 16 fps: 0.56 s of video over 0.33 s
    of sound; and ``--fps 12`` left frame_rate at 24: 0.75 s of video over 0.33 s."""
    out = str(tmp_path / "clip.mp4")
    generate(*flags, "--out", out)
    audio, rate, _ = read_audio(out)
    frames, video_fps = video_stream(out)
    assert video_fps == fps
    vae = diffusers_ltx2.audio_vae.config
    slack = 1 / fps + 3 * vae.mel_hop_length / vae.sample_rate
    seconds = audio.shape[-1] / rate
    assert abs(seconds - frames / video_fps) <= slack, \
        f"{seconds:.3f} s of sound under {frames / video_fps:.3f} s of video"
