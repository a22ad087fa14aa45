"""Near-duplicate texts: MinHash over word 3-grams, banded for candidates, confirmed by exact Jaccard similarity.

    index = NearDuplicates(threshold=0.7)
    index.add("Write a poem about the sea.")      # True: new
    index.add("write a poem about the sea!!")     # False: same words after `normalize_text`
    index.seen("Write a short poem about the sea.")  # True when its 3-gram Jaccard with a kept text >= threshold

A text's shingles are the hashed word 3-grams of its `normalize_text` form (one shingle, the whole text, when
it has fewer than three words). Its signature is `BANDS x ROWS` MinHash values; two texts become candidates when
one band of their signatures agrees (likely from a Jaccard similarity of about (1/BANDS)^(1/ROWS) = 0.5 on),
and a candidate is a duplicate when the exact Jaccard similarity of the shingle sets reaches `threshold`.
Deterministic: the hash functions come from a fixed seed, shingles are hashed with CRC-32.
"""

from __future__ import annotations

import collections
import zlib

import numpy as np

from train.chat import normalize_text

BANDS, ROWS = 16, 4
_PRIME = (1 << 31) - 1
_SEEDS = np.random.default_rng(20261201).integers(1, _PRIME, size=(2, BANDS * ROWS), dtype=np.int64)


def shingles(text: str, n: int = 3) -> frozenset[int]:
    """CRC-32 hashes of the word n-grams of `normalize_text(text)` (the whole text when shorter than n words)."""
    words = normalize_text(text).split()
    grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)] or [" ".join(words)]
    return frozenset(zlib.crc32(g.encode("utf-8")) for g in grams)


def signature(grams: frozenset[int]) -> np.ndarray:
    """`[BANDS * ROWS]` MinHash values of a shingle set: per hash function (a x + b) mod p, the minimum."""
    x = np.fromiter(grams, np.int64, len(grams)) % _PRIME
    a, b = _SEEDS
    return ((a[:, None] * x[None, :] + b[:, None]) % _PRIME).min(axis=1)


def jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """An index of kept texts; `add` keeps a text unless it near-duplicates one already kept."""

    def __init__(self, threshold: float = 0.7):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self.kept: list[frozenset[int]] = []
        self.buckets: dict[tuple, list[int]] = collections.defaultdict(list)

    def _bands(self, grams: frozenset[int]) -> list[tuple]:
        sig = signature(grams)
        return [(band, *sig[band * ROWS : (band + 1) * ROWS].tolist()) for band in range(BANDS)]

    def _match(self, grams: frozenset[int], bands: list[tuple]) -> bool:
        candidates = {i for key in bands for i in self.buckets.get(key, ())}
        return any(jaccard(grams, self.kept[i]) >= self.threshold for i in candidates)

    def seen(self, text: str) -> bool:
        """Whether `text` near-duplicates a kept text (nothing is added)."""
        grams = shingles(text)
        return self._match(grams, self._bands(grams))

    def add(self, text: str) -> bool:
        """Keep `text` unless it near-duplicates a kept text -> whether it was kept."""
        grams = shingles(text)
        bands = self._bands(grams)
        if self._match(grams, bands):
            return False
        for key in bands:
            self.buckets[key].append(len(self.kept))
        self.kept.append(grams)
        return True
