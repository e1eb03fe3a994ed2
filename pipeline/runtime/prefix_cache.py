"""Prefix caching: the K/V of prompt blocks kept across requests, so a shared system prompt or the earlier
turns of a chat are prefilled once.

A prompt is cut into blocks of `block_tokens` from its first token; a block is named by a hash chain over
the blocks before it and its own tokens (blake2b, 128 bits), so equal names mean equal token prefixes at
equal positions. Each cached block holds, for every layer, the K/V its tokens produced ([kv_heads, block,
head_dim]; sliding layers too: a later prompt may share only an earlier part of the prefix). The store is
bounded by a memory budget and evicts the least recently used blocks, a chain's deepest blocks first (a
block is reachable only through its ancestors, so an ancestor is never dropped before its descendants).

Exact by construction: the runtime prefills every prompt in chunks that end at these same block
boundaries, whether caching is on or off, so a cached block holds bit for bit the K/V a cold prefill of
the same prefix computes (the same pass over the same tokens with the same past), and a warm request's
remaining chunks run exactly as they would cold. Hence tokens identical to a run with caching off.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V) of one block, [kv_heads, block, head_dim]


@dataclass
class CachedBlock:
    key: bytes
    tokens: tuple[int, ...]  # checked on every hit: a name never stands in for the tokens themselves
    kv: KV
    nbytes: int


@dataclass
class PrefixStats:
    """Cumulative counts since the cache was made (the server exports them as Prometheus counters)."""

    lookups: int = 0  # prompts looked up
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, tokens whose K/V came from the cache
    inserted_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class PrefixCache:
    block_tokens: int
    budget_bytes: int
    blocks: OrderedDict[bytes, CachedBlock] = field(default_factory=OrderedDict)  # LRU order, oldest first
    nbytes: int = 0
    stats: PrefixStats = field(default_factory=PrefixStats)

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The chain names of the prompt's full blocks."""
        keys, parent = [], b""
        for start in range(0, len(prompt) - self.block_tokens + 1, self.block_tokens):
            block = prompt[start : start + self.block_tokens]
            parent = hashlib.blake2b(parent + _token_bytes(block), digest_size=16).digest()
            keys.append(parent)
        return keys

    def count_prompt(self, prompt: Sequence[int]) -> None:
        """A prompt is about to be looked up: its tokens are the hit rate's denominator (once per prompt)."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(prompt)

    def lookup(
        self, prompt: Sequence[int], first: int = 0, keys: list[bytes] | None = None
    ) -> list[CachedBlock]:
        """The longest run of cached blocks of the prompt from its block `first` on (the blocks before it are
        the caller's already), marked recent; the blocks returned count as hits in `stats`. `keys`: the
        prompt's `keys()`, when the caller holds them (a prompt prefilled block by block)."""
        found: list[CachedBlock] = []
        keys = self.keys(prompt) if keys is None else keys
        for i in range(first, len(keys)):
            block = self.blocks.get(keys[i])
            start = i * self.block_tokens
            if block is None or block.tokens != tuple(prompt[start : start + self.block_tokens]):
                break
            found.append(block)
        self.stats.hit_tokens += len(found) * self.block_tokens
        self._touch(keys[: first + len(found)])
        return found

    def insert(self, prompt: Sequence[int], index: int, kv: KV, keys: list[bytes] | None = None) -> None:
        """Keep the K/V of the prompt's block `index` (its full tokens), evicting least recently used blocks
        to stay within the budget. A block larger than the whole budget is not kept. `keys` as in `lookup`."""
        if keys is None:
            keys = self.keys(prompt[: (index + 1) * self.block_tokens])
        key = keys[index]
        if key in self.blocks:
            self._touch([key])
            return
        nbytes = sum(t.numel() * t.element_size() for pair in kv for t in pair)
        if nbytes > self.budget_bytes:
            return
        while self.nbytes + nbytes > self.budget_bytes:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self.stats.evicted_blocks += 1
        start = index * self.block_tokens
        tokens = tuple(prompt[start : start + self.block_tokens])
        self.blocks[key] = CachedBlock(key, tokens, kv, nbytes)
        self.nbytes += nbytes
        self.stats.inserted_blocks += 1
        self._touch(keys[:index])  # its ancestors stay more recent (evicted after it)

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain (root first) most recently used, deepest block first, so its root is the most recent
        and LRU eviction takes leaves before their ancestors."""
        for key in reversed(chain):
            if key in self.blocks:
                self.blocks.move_to_end(key)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array(
        "I", tokens
    ).tobytes()  # token ids are < 2^32 (the runtime checks them against the vocabulary)
