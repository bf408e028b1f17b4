"""Prompt embeddings of different token lengths in one denoiser call: zero-padded to the longest, with the
key-padding mask that hides the padding (what batching requests with different prompts needs)."""

from __future__ import annotations

import torch


def pad_text(embeds: list[torch.Tensor], masks: list[torch.Tensor | None] | None, rows: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack per-request ``[1, L_i, D]`` prompt embeddings into ``[sum(rows), max L, D]`` with zero padding
    (each repeated for the request's ``rows``), and the ``[sum(rows), max L]`` key-padding mask (True =
    attend) built from the requests' own masks (None: all valid) and the padding. The mask is None when
    nothing is masked, which is what diffusers passes for a single prompt, so one request alone computes
    exactly what diffusers computes."""
    masks = masks if masks is not None else [None] * len(embeds)
    longest = max(e.shape[1] for e in embeds)
    if all(m is None for m in masks) and all(e.shape[1] == longest for e in embeds):  # nothing to pad or mask
        if len(embeds) == 1:
            return embeds[0].expand(rows[0], -1, -1), None
        return torch.cat([e.expand(r, -1, -1) for e, r in zip(embeds, rows)]), None
    parts, mask_parts = [], []
    for e, m, r in zip(embeds, masks, rows):
        length = e.shape[1]
        valid = m.bool() if m is not None else torch.ones(e.shape[:2], dtype=torch.bool, device=e.device)
        if length < longest:
            e = torch.cat([e, e.new_zeros(e.shape[0], longest - length, e.shape[2])], dim=1)
            valid = torch.cat([valid, valid.new_zeros(valid.shape[0], longest - length)], dim=1)
        parts.append(e.expand(r, -1, -1))
        mask_parts.append(valid.expand(r, -1))
    mask = torch.cat(mask_parts)
    return torch.cat(parts), (None if bool(mask.all()) else mask)


__all__ = ["pad_text"]
