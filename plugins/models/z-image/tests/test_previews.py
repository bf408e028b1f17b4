"""Previews that look like the picture (issue #37): on the tiny random Z-Image model, a projection fitted by
``omni preview calibrate``'s code beats the old channel preview by 6 dB against the VAE decode of a mid-run
step's clean estimate, and ``preview()`` uses a folder's ``preview_projection.json``."""

from __future__ import annotations

from omni_core.testing.previews import check_preview_projection


def test_projection_preview_beats_the_channel_preview(omni_zimage):
    check_preview_projection(omni_zimage, sampling={"height": 32, "width": 32})
