"""Near-duplicate prompts between a held-out set and the data a drafter trained on.

ShareGPT holds the same request asked by many users, and long conversations cut into parts
whose ids differ only in a suffix: a held-out split drawn by id alone keeps prompts the
drafter has seen almost word for word, and overstates what new prompts will get. Two
prompts are near-duplicates when the Jaccard similarity of their sets of n-token shingles
is at least a threshold; MinHash with banding (locality-sensitive hashing) finds the
candidate pairs without comparing every pair, and each candidate's Jaccard similarity is
then computed exactly."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

SHINGLE = 5            # tokens per shingle
THRESHOLD = 0.5        # Jaccard similarity at which two prompts count as the same
NUM_HASHES = 64        # MinHash signature length
BANDS = 32             # LSH bands of 2 rows: a pair at 0.5 shares a band with p = 1 - (1 - 0.5^2)^32 > 0.9999
_PRIME = (1 << 61) - 1


def shingles(tokens: Sequence[int], n: int = SHINGLE) -> set[int]:
    """The prompt's n-token windows as integers (a prompt shorter than n is one shingle)."""
    tokens = [int(t) for t in tokens]
    if len(tokens) < n:
        return {hash(tuple(tokens))}
    return {hash(tuple(tokens[i:i + n])) for i in range(len(tokens) - n + 1)}


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class MinHasher:
    def __init__(self, num_hashes: int = NUM_HASHES, bands: int = BANDS, seed: int = 0) -> None:
        if num_hashes % bands:
            raise ValueError(f"num_hashes={num_hashes} must be a multiple of bands={bands}")
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _PRIME, size=num_hashes, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, size=num_hashes, dtype=np.uint64)
        self.bands = bands

    def signature(self, items: set[int]) -> np.ndarray:
        """[num_hashes] minimum of (a * x + b) mod 2^64 over the set: a permutation-free MinHash."""
        x = np.fromiter((i & 0xFFFFFFFFFFFFFFFF for i in items), dtype=np.uint64, count=len(items))
        with np.errstate(over="ignore"):  # arithmetic mod 2^64 is the point
            return (x[:, None] * self.a[None, :] + self.b[None, :]).min(axis=0)

    def band_keys(self, signature: np.ndarray) -> list[bytes]:
        return [band.tobytes() + bytes([i]) for i, band in enumerate(np.split(signature, self.bands))]


@dataclass(frozen=True)
class Match:
    query: int     # index into the queries
    corpus: int    # index into the corpus
    similarity: float


def near_duplicates(queries: Sequence[Sequence[int]], corpus: Sequence[Sequence[int]], *,
                    threshold: float = THRESHOLD, n: int = SHINGLE) -> list[Match]:
    """For each query with a near-duplicate in the corpus, its most similar corpus prompt
    (Jaccard of n-token shingles >= threshold), in query order."""
    hasher = MinHasher()
    buckets: dict[bytes, list[int]] = defaultdict(list)
    corpus_shingles = [shingles(c, n) for c in corpus]
    for index, items in enumerate(corpus_shingles):
        for key in hasher.band_keys(hasher.signature(items)):
            buckets[key].append(index)
    found = []
    for q, query in enumerate(queries):
        items = shingles(query, n)
        candidates = {c for key in hasher.band_keys(hasher.signature(items)) for c in buckets.get(key, ())}
        scored = [(jaccard(items, corpus_shingles[c]), c) for c in candidates]
        best = max(scored, default=(0.0, -1))
        if best[0] >= threshold:
            found.append(Match(q, best[1], best[0]))
    return found
