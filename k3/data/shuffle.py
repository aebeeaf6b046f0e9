"""Seeded orders: the permutations that fix a packed stream's document order, each epoch's row order and a
tokenizer's sample.

They are a function of (seed, stream name) only, the same on every platform and library version (a keyed
bijective hash, not a random generator), so a run and its resumption, on any machine, visit the same data.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (uint64 arithmetic wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_permutation(n: int, seed: int, stream: str) -> np.ndarray:
    """A permutation of range(n) fixed by (seed, stream) on every platform and library version: indices sorted
    by a keyed bijective hash (distinct keys, so no ties)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{stream}".encode()).digest()[:8], "little")
    return np.argsort(_splitmix64(np.arange(n, dtype=np.uint64) ^ np.uint64(key)), kind="stable")
