"""Previews that look like the picture (issue #37): on the tiny random FLUX.1 model, a projection fitted by
``omni preview calibrate``'s code beats the old channel preview by 6 dB against the VAE decode of a mid-run
step's clean estimate, and ``preview()`` uses a folder's ``preview_projection.json``."""

from __future__ import annotations

from omni_core.testing.previews import check_preview_projection, check_shipped_projections


def test_projection_preview_beats_the_channel_preview(omni_flux):
    check_preview_projection(omni_flux, sampling={"height": 32, "width": 32})


def test_shipped_projections_parse_and_are_not_for_the_tiny_vae(omni_flux):
    check_shipped_projections(omni_flux)
