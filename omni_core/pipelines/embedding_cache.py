"""A bounded LRU of text-encoder outputs, shared by every request a model process serves.

The same prompt is encoded again and again in real traffic (a product shot, a negative prompt every request
shares, an RL rollout with one prompt and many seeds). Each model process keeps one :class:`EmbeddingCache`
(``pipeline.embedding_cache``, attached by :func:`attach_embedding_cache` when the pipeline is loaded; its
size is the engine option ``embedding_cache_bytes``, 0 turns it off) and a pipeline's ``encoded_prompts``
window reads it: a text seen before skips the text encoder.

What a hit returns is exactly what the miss computed: a pipeline stores what a request *alone* gets (a
diffusers model encodes its misses one text at a time, since a padded batch may change the last bits; a model
whose encoder is batch-invariant may batch them), so with the cache a request's encodings, and so its image,
do not depend on which requests share its wave. Keys are ``(scope, key)``: the scope names the encoder
(component and model folder; a pipeline whose text encoder carries LoRA adapters gives none and bypasses the
cache), the key is the model's own text key, which holds every option that changes the encoding (the text,
``max_sequence_length``, an edit model's input-image digest).

Values are tensors or tuples/lists/dicts of them (and None). They are stored as detached copies of their own
(a row of a batched encoding would otherwise keep the whole batch alive and its bytes uncounted) and every
read gets a fresh copy, so no caller's in-place op can reach a stored tensor. Thread-safe, and a key that
several CPU lanes miss at once is encoded once (the others wait for it).

Import-light: torch is imported only when a value is copied or measured.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Callable, Hashable, Iterable

logger = logging.getLogger("omni_core.pipelines.embedding_cache")

#: the default of ``embedding_cache_bytes``: ~60 Wan or Flux T5 encodings (512 x 4096 in bf16 = 4 MiB each),
#: hundreds of short Qwen-Image prompts
DEFAULT_EMBEDDING_CACHE_BYTES = 256 * 1024 * 1024

#: the counters ``stats()`` reports (summed over data-parallel replicas by the engine)
STAT_KEYS = ("hits", "misses", "entries", "bytes", "capacity_bytes", "evictions")


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (nested tuples, lists and dicts; anything else as is)."""
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if hasattr(value, "untyped_storage"):
        return fn(value)
    return value


def value_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (each counted at its own size: stored values own their storage)."""
    total = 0

    def add(t: Any) -> Any:
        nonlocal total
        total += t.nelement() * t.element_size()
        return t

    map_tensors(value, add)
    return total


def _own_copy(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().clone())


class EmbeddingCache:
    """Text encodings by ``(scope, key)``, least recently used first, at most ``capacity_bytes`` in all."""

    def __init__(self, capacity_bytes: int = DEFAULT_EMBEDDING_CACHE_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"embedding_cache_bytes must be >= 0 (0 turns the cache off), got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._inflight: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        #: names this cache in the engine's sum over processes (a process may hold several engines' pipelines)
        self.source = f"{os.getpid()}:{id(self):x}"

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get_or_encode(self, keys: Iterable[Hashable], encode: Callable[[list], dict]) -> dict:
        """``{key: value}`` for the distinct ``keys``: hits copied out of the cache, misses from ONE call
        ``encode(missing_keys) -> {key: value}`` (stored, and given to the caller as computed). A key another
        thread is encoding right now is waited for rather than encoded twice."""
        keys = list(dict.fromkeys(keys))
        found: dict = {}
        mine: list = []
        waits: list[tuple[Hashable, threading.Event]] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    found[key] = entry[0]
                    self.hits += 1
                elif key in self._inflight:
                    waits.append((key, self._inflight[key]))
                else:
                    self._inflight[key] = threading.Event()
                    mine.append(key)
            self.misses += len(mine)
        out = {key: _own_copy(value) for key, value in found.items()}
        if mine:
            computed: dict = {}
            try:
                computed = encode(mine)
                out.update((key, computed[key]) for key in mine)
            finally:
                with self._lock:
                    for key in mine:
                        if key in computed:
                            self._store(key, _own_copy(computed[key]))
                        self._inflight.pop(key).set()
        for key, event in waits:
            event.wait()
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                else:  # its encoder call failed, or it was too large to keep: encode it here
                    self.misses += 1
            out[key] = _own_copy(entry[0]) if entry is not None else encode([key])[key]
        return out

    def _store(self, key: Hashable, value: Any) -> None:
        """Insert ``value`` (the lock held); evict from the cold end until it fits. A value larger than the
        whole cache is not kept."""
        size = value_bytes(value)
        if not self.enabled or size > self.capacity_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        while self._entries and self.bytes + size > self.capacity_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
            self.evictions += 1
        self._entries[key] = (value, size)
        self.bytes += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, Any]:
        """``hits``, ``misses`` (texts looked up), ``entries``, ``bytes`` (held now), ``capacity_bytes``,
        ``evictions`` and ``source`` (which cache: the engine sums its caches' last snapshots)."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "entries": len(self._entries), "bytes": self.bytes,
                    "capacity_bytes": self.capacity_bytes, "evictions": self.evictions, "source": self.source}


def attach_embedding_cache(pipeline: Any, config: Any) -> EmbeddingCache | None:
    """Give ``pipeline`` its process's cache (``config.embedding_cache_bytes``; none when 0)."""
    capacity = getattr(config, "embedding_cache_bytes", DEFAULT_EMBEDDING_CACHE_BYTES)
    cache = EmbeddingCache(capacity) if capacity else None
    try:
        pipeline.embedding_cache = cache
    except AttributeError:  # a pipeline with __slots__ or a read-only attribute: it runs without one
        return None
    return cache


def embedding_cache_snapshot(pipeline: Any) -> Callable[[], dict]:
    """A metrics source for the runner's wave clock: ``{"embedding_cache": [stats]}`` of ``pipeline``'s cache
    (empty without one)."""
    def snapshot() -> dict:
        cache = getattr(pipeline, "embedding_cache", None)
        return {"embedding_cache": [cache.stats()]} if cache is not None else {}

    return snapshot


def sum_embedding_caches(snapshots: Iterable[dict]) -> dict[str, int]:
    """The engine's view: each cache's last snapshot summed (one cache per data-parallel replica; with tensor
    or sequence parallelism rank 0's, the other ranks hold the same texts)."""
    total = dict.fromkeys(STAT_KEYS, 0)
    for snap in snapshots:
        for k in STAT_KEYS:
            total[k] += snap.get(k, 0)
    return total


def carried_encodings(states: Iterable[Any], device: Any) -> dict | None:
    """The encodings the encode stage computed for ``states`` (``request.text_encodings``, ``encode_workers``),
    merged by text key and moved to ``device`` as copies of their own (a pipeline may work on them in place, and
    a preempted request reads them again); None unless every state carries them (then the process encodes)."""
    found = [getattr(getattr(s, "request", None), "text_encodings", None) for s in states]
    if not found or any(f is None for f in found):
        return None
    memo: dict = {}
    for encodings in found:
        for key, value in encodings.items():
            if key not in memo:
                memo[key] = map_tensors(value, lambda t: t.to(device, copy=True))
    return memo


def text_encoders_have_adapters(modules: Iterable[Any]) -> bool:
    """Whether any of the text-encoder ``modules`` carries (peft) LoRA adapters: its outputs then depend on
    which adapters are active, which the cache's key does not hold, so the cache is bypassed."""
    return any(bool(getattr(m, "peft_config", None)) or bool(getattr(m, "_hf_peft_config_loaded", False))
               for m in modules if m is not None)


__all__ = ["DEFAULT_EMBEDDING_CACHE_BYTES", "EmbeddingCache", "attach_embedding_cache", "carried_encodings",
           "embedding_cache_snapshot",
           "map_tensors", "sum_embedding_caches", "text_encoders_have_adapters", "value_bytes"]
