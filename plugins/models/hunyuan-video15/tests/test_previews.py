"""Previews that look like the video (issue #37): on the tiny random model, a latent-to-RGB projection fitted by
``omni preview calibrate``'s code beats the channel preview by 6 dB against the VAE decode of a mid-run step's
clean estimate, and ``preview()`` uses a folder's ``preview_projection.json`` (four latent frames tiled 2x2). No
projection is shipped for the released VAE (no published latent-RGB factors exist for its 32 channels): a released
folder gets one with ``omni preview calibrate --model <folder> --write``."""

from __future__ import annotations

from omni_core.testing.previews import check_preview_projection


def test_projection_preview_beats_the_channel_preview(omni_hv):
    numbers = check_preview_projection(omni_hv, sampling={"height": 16, "width": 16, "num_frames": 9})
    print(numbers)
