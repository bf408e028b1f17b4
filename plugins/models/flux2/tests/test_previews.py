"""Previews that look like the picture: on the tiny random [klein] model a projection fitted by ``omni preview
calibrate``'s code beats the channel preview against the VAE decode of a mid-run clean estimate, and ``preview()``
uses a folder's ``preview_projection.json``."""

from __future__ import annotations

from omni_core.testing.previews import check_preview_projection


def test_projection_preview_beats_the_channel_preview(omni_klein):
    check_preview_projection(omni_klein, sampling={"height": 32, "width": 32, "max_sequence_length": 48})
