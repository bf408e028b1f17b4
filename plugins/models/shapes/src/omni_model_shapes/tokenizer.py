"""A word-level tokenizer over the closed vocabulary (``vocab.json``); unknown words map to ``<unk>``.

Every sequence starts with ``<bos>``, so even the empty (negative) prompt has one token to attend to.
"""

from __future__ import annotations

import json
import os
import re

PAD, UNK, BOS = "<pad>", "<unk>", "<bos>"
SPECIAL_TOKENS = (PAD, UNK, BOS)
#: spellings folded onto the training vocabulary
ALIASES = {"centre": "center", "middle": "center", "big": "large"}

_WORD = re.compile(r"[a-z]+")


class ShapesTokenizer:
    """Lower-cases, splits into letter runs, maps words to ids, pads to ``max_length``."""

    def __init__(self, vocab: dict[str, int], max_length: int = 16) -> None:
        for i, tok in enumerate(SPECIAL_TOKENS):
            if vocab.get(tok) != i:
                raise ValueError(f"vocab must map {tok!r} to {i}, got {vocab.get(tok)!r}")
        self.vocab = dict(vocab)
        self.max_length = max_length
        self.pad_id, self.unk_id, self.bos_id = 0, 1, 2

    @classmethod
    def from_words(cls, words: list[str], max_length: int = 16) -> ShapesTokenizer:
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for w in words:
            vocab.setdefault(w, len(vocab))
        return cls(vocab, max_length)

    @classmethod
    def from_pretrained(cls, path: str) -> ShapesTokenizer:
        with open(os.path.join(path, "vocab.json")) as f:
            data = json.load(f)
        return cls(data["vocab"], data["max_length"])

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "vocab.json"), "w") as f:
            json.dump({"max_length": self.max_length, "vocab": self.vocab}, f, indent=1)

    def __len__(self) -> int:
        return len(self.vocab)

    def words(self, text: str) -> list[str]:
        return [ALIASES.get(w, w) for w in _WORD.findall(text.lower())]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with ``<bos>``, truncated to ``max_length`` (no padding)."""
        ids = [self.bos_id] + [self.vocab.get(w, self.unk_id) for w in self.words(text)]
        return ids[: self.max_length]

    def unknown_words(self, text: str) -> list[str]:
        return [w for w in self.words(text) if w not in self.vocab]

    def __call__(self, texts: list[str]):
        """``(input_ids, attention_mask)`` as ``[B, max_length]`` long / bool tensors."""
        import torch

        ids = torch.full((len(texts), self.max_length), self.pad_id, dtype=torch.long)
        for i, text in enumerate(texts):
            row = self.encode(text)
            ids[i, : len(row)] = torch.tensor(row)
        return ids, ids != self.pad_id
