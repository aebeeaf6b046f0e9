"""Prefix caching for the hybrid model: token blocks hashed in a chain, KDA state snapshots, MLA latents.

A sequence's tokens are cut into blocks of ``block_size``; block i's key is a hash of block i-1's key and
block i's tokens, so a key names the whole prefix up to the end of block i. Each entry keeps
- that block's MLA latent rows [c_kv, k_pe] for every MLA layer: a prefix is rebuilt by concatenating the
  rows of its blocks, so no latent is stored twice;
- optionally the KDA recurrent + conv state of every KDA layer at the block's end. A recurrent state can only
  be snapshotted where the engine stops a forward pass (a prefill chunk end, every decode step), so only such
  blocks carry one, and a request can resume only at a block that does.
A lookup walks the chain from the first block and resumes at the deepest state-carrying block of the
contiguous run it finds. Entries are evicted least-recently-used under a byte budget; every lookup and
insert refreshes the whole chain root-last, so parents outlive their children and a chain erodes from its
tip, never from its root.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class BlockEntry:
    parent: bytes | None
    latents: list[Tensor]  # per MLA layer [block_size, r + dr]
    kda: list[tuple[Tensor, list[Tensor]]] | None  # per KDA layer (recurrent, [q, k, v] conv) at the block end

    @property
    def nbytes(self) -> int:
        n = sum(_nbytes(t) for t in self.latents)
        if self.kda is not None:
            n += sum(_nbytes(r) + sum(_nbytes(c) for c in conv) for r, conv in self.kda)
        return n


@dataclass
class PrefixHit:
    length: int  # tokens covered (a multiple of block_size)
    kda: list[tuple[Tensor, list[Tensor]]]
    latents: list[Tensor]  # per MLA layer [length, r + dr]


class PrefixCache:
    def __init__(self, block_size: int, budget_bytes: int):
        if block_size < 1 or budget_bytes < 0:
            raise ValueError(f"block_size={block_size} must be >= 1 and budget_bytes={budget_bytes} >= 0")
        self.block_size, self.budget = block_size, budget_bytes
        self.entries: OrderedDict[bytes, BlockEntry] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def keys(self, tokens: list[int]) -> list[bytes]:
        """Chain keys of every full block of ``tokens``."""
        out, h = [], b""
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            block = tokens[start : start + self.block_size]
            h = hashlib.sha256(h + b"|" + ",".join(map(str, block)).encode()).digest()
            out.append(h)
        return out

    def _refresh(self, key: bytes | None) -> None:
        """Mark key and its ancestors used, the root last (most recent)."""
        chain = []
        while key is not None and key in self.entries:
            chain.append(key)
            key = self.entries[key].parent
        for k in chain:
            self.entries.move_to_end(k)

    def lookup(self, tokens: list[int], max_tokens: int) -> PrefixHit | None:
        """The longest cached, resumable prefix of ``tokens`` covering at most ``max_tokens`` tokens."""
        keys = self.keys(tokens[:max_tokens])
        run = 0
        while run < len(keys) and keys[run] in self.entries:
            run += 1
        depth = next((i for i in range(run, 0, -1) if self.entries[keys[i - 1]].kda is not None), 0)
        if depth == 0:
            self.misses += 1
            return None
        self.hits += 1
        self._refresh(keys[depth - 1])
        chain = [self.entries[k] for k in keys[:depth]]
        return PrefixHit(
            length=depth * self.block_size,
            kda=chain[-1].kda,
            latents=[torch.cat([e.latents[j] for e in chain]) for j in range(len(chain[0].latents))],
        )

    def insert(
        self, key: bytes, parent: bytes | None, latents: list[Tensor], kda: list[tuple[Tensor, list[Tensor]]] | None
    ) -> None:
        """Add (or complete with a KDA state) the entry of one block; then evict down to the budget."""
        old = self.entries.get(key)
        if old is not None:
            if old.kda is None and kda is not None:
                self.nbytes -= old.nbytes
                old.kda = kda
                self.nbytes += old.nbytes
        else:
            entry = BlockEntry(parent, [t.clone() for t in latents], kda)
            if entry.nbytes > self.budget:
                return
            self.entries[key] = entry
            self.nbytes += entry.nbytes
        self._refresh(key)
        while self.nbytes > self.budget and self.entries:
            _, evicted = self.entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1

    def stats(self) -> dict:
        return {
            "entries": len(self.entries),
            "bytes": self.nbytes,
            "budget_bytes": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
