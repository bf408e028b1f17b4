"""Previews that look like the picture: on the tiny random Qwen-Image 2.1 folder, a latent-to-RGB projection fitted
by ``omni preview calibrate``'s code (the decode's RGB channels: the 2.1 VAE's alpha is dropped) beats the channel
preview by 6 dB against the VAE decode of a mid-run step's clean estimate, and ``preview()`` uses a folder's
``preview_projection.json``. No projection is shipped for the released 2.1 VAE (no published factors; fit one with
``omni preview calibrate --model <folder> --write``)."""

from __future__ import annotations

from omni_core.testing.previews import check_preview_projection


def test_projection_preview_beats_the_channel_preview(omni_q21):
    numbers = check_preview_projection(omni_q21, sampling={"height": 32, "width": 32})
    print(f"preview PSNR against the decode: channel {numbers['channel']:.1f} dB, projection "
          f"{numbers['projection']:.1f} dB (kernel {numbers['kernel']})")
