"""The text-encoding window a pipeline mixes in: prompts of requests that start together encoded once, through
the process's embedding cache, or read from what the encode stage computed.

Why a mixin of the core: the embedding cache (:mod:`omni_core.pipelines.embedding_cache`) and the encode stage
(``encode_workers``, :mod:`omni_core.worker.stages`) need the same three things of every model, and a model
plugin, ours or a third party's, should get both by declaring them rather than by writing the mechanism:

* ``text_keys(state)``: the hashable texts ``prepare_encode`` will encode for ``state``, each holding everything
  its encoding depends on besides the encoder (the text, ``max_sequence_length``);
* ``encode_prompts(keys) -> {key: encoding}``: the text encoder on those keys;
* ``prepare_encode`` reads each text through :meth:`TextEncodingWindow.encoded_text`: the window put every
  state's encodings on the state (``StepState.text_encodings``); a text it did not encode is encoded alone.

``DiffusersStepPipeline`` mixes it in; another pipeline writes ``class MyPipeline(TextEncodingWindow,
OmniPipeline)``. The window keeps nothing on the pipeline: what it encoded travels with each request's state.
"""

from __future__ import annotations

import contextlib
from typing import Any

from omni_core.pipelines.embedding_cache import carried_encodings, text_encoders_have_adapters


class TextEncodingWindow:
    """``encoded_prompts`` from ``text_keys`` / ``encode_prompts`` (see the module's docstring)."""

    @contextlib.contextmanager
    def encoded_prompts(self, states: list):
        """Each state gets its texts' encodings (``state.text_encodings``, by key; yielded too, all of the wave's)
        from one batched :meth:`encode_prompts` over the wave's distinct texts (keys from :meth:`text_keys`). A request alone encodes its texts one by one, as diffusers does
        (a batch of prompts of different lengths is padded and masked).

        With the process's embedding cache (``embedding_cache``) every text of the wave, a lone request's too,
        comes from the cache or, missed, from its own :meth:`encode_prompts` call: what a request alone
        computes, so a hit gives those bits and a request's encodings do not depend on its wave.

        Requests the encode stage encoded (``request.text_encodings``, ``encode_workers``) carry their encodings,
        computed there by this window with a cache: they are read as they are, and no text encoder runs here."""
        memo = carried_encodings(states, getattr(self, "device", "cpu"))
        if memo is None:
            memo = self._encode_window(states)
        for state in states:
            state.text_encodings = {k: memo[k] for k in self.text_keys(state) if k in memo}
        yield memo

    @staticmethod
    def encoded_text(state: Any, key: Any, encode: Any) -> Any:
        """``key``'s encoding for ``state`` as the window made it (``state.text_encodings``), else ``encode()``:
        the text alone. What ``prepare_encode`` calls for each text of :meth:`text_keys`."""
        encodings = getattr(state, "text_encodings", None) or {}
        return encodings[key] if key in encodings else encode()

    def _encode_window(self, states: list) -> dict:
        cache = getattr(self, "embedding_cache", None)
        scope = self.text_cache_scope() if cache is not None else None
        keys: list = []
        for s in states if len(states) > 1 or (cache is not None and scope is not None) else []:
            for key in self.text_keys(s):
                if key not in keys:
                    keys.append(key)
        if cache is not None and scope is not None:
            return self._cached_encodings(cache, scope, keys)
        return self.encode_prompts(keys) if len(keys) > 1 else {}

    def _cached_encodings(self, cache: Any, scope: Any, keys: list) -> dict:
        """``{key: encoding}`` for ``keys`` through ``cache``: misses encoded one key per call (a padded batch
        may differ from the text alone in the last bits, and the cache must hold what a request alone gets)."""
        by_cache_key = {(scope, self.text_cache_key(k)): k for k in keys}

        def encode(missing: list) -> dict:
            return {ck: self.encode_prompts([by_cache_key[ck]])[by_cache_key[ck]] for ck in missing}

        got = cache.get_or_encode(list(by_cache_key), encode)
        return {key: got[ck] for ck, key in by_cache_key.items()}

    def text_keys(self, state: Any) -> list:
        """The hashable texts ``prepare_encode`` will encode for ``state`` (none: no batched encoding). Each key
        holds everything its encoding depends on besides the encoder (the text, ``max_sequence_length``, ...):
        the embedding cache keys by it."""
        return []

    def text_cache_key(self, key: Any) -> Any:
        """What the embedding cache keeps ``key`` (one of :meth:`text_keys`) as: the key itself, or a lighter
        equal-deciding form (an edit model's key without its images)."""
        return key

    def text_cache_scope(self) -> Any:
        """The text encoder's identity in the embedding cache: its components and the model folder; None (the
        cache is bypassed) while a text encoder carries LoRA adapters, whose outputs the key cannot tell apart."""
        from omni_core.optimize.components import components_of

        encoders = {n: m for n, m in components_of(self).items() if n.startswith("text_encoder")}
        if text_encoders_have_adapters(encoders.values()):
            return None
        return (type(self).__name__, getattr(self, "omni_model_path", None), tuple(encoders))

    def encode_prompts(self, keys: list) -> dict:
        """``{key: encoding}`` for the keys of :meth:`text_keys`, in as few text-encoder calls as possible."""
        return {}


def declares_text_keys(pipeline_cls: type) -> bool:
    """Whether ``pipeline_cls`` can encode apart: a :class:`TextEncodingWindow` with its own ``text_keys``, or a
    pipeline with its own ``encoded_prompts`` window (which then reads ``request.text_encodings`` itself)."""
    if issubclass(pipeline_cls, TextEncodingWindow):
        return pipeline_cls.text_keys is not TextEncodingWindow.text_keys
    from omni_core.pipelines.base import OmniPipeline

    return getattr(pipeline_cls, "encoded_prompts", None) is not OmniPipeline.encoded_prompts


__all__ = ["TextEncodingWindow", "declares_text_keys"]
