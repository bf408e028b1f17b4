"""A last block that drops a carried stream (returns None for it, as a last joint block that keeps only the image
does) with rows of one call deciding differently: the merged output keeps that stream None (author gap 6:
``TypeError: 'NoneType' object is not subscriptable``)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")


def test_merge_keeps_a_dropped_stream_none():
    from omni_cache_teacache.backend import TeaCacheBackend, TeaState, _Call, _Segment

    spec = types.SimpleNamespace(residual_stream="hidden_states",
                                 block_outputs=("encoder_hidden_states", "hidden_states"))
    computed, reused = TeaState(), TeaState(residual=torch.full((1, 3), 0.5))
    call = _Call(den=types.SimpleNamespace(spec=spec), mode="slice",
                 segments=[_Segment(None, 0, 1, ("a",), computed, compute=True),
                           _Segment(None, 1, 2, ("b",), reused, compute=False)],
                 in0={"hidden_states": torch.zeros(2, 3), "encoder_hidden_states": torch.ones(2, 5)})
    out = TeaCacheBackend._finish(TeaCacheBackend.__new__(TeaCacheBackend), call, (None, torch.full((1, 3), 2.0)))
    text, image = out
    assert text is None
    assert image.tolist() == [[2.0, 2.0, 2.0], [0.5, 0.5, 0.5]]  # computed row, then block-0 input + residual
