"""The KV cache's read: a sliding layer's ring is read only as far as it holds tokens, and attention over
that read equals attention over the whole ring."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.model.network import canvas_positions
from pipeline.runtime.kv_cache import KeyMeta, KVCache, attention_masks
from tests._utils.tiny import build_tiny

SLIDING, GLOBAL = 0, 2  # the tiny model's layer types: sliding, sliding, full


def _fill(cache: KVCache, lengths: list[int], seed: int = 0) -> None:
    """Write `lengths[r]` random tokens' K/V into row r, as a causal pass does."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    slots = torch.arange(len(lengths))
    pos = canvas_positions(cache.lengths[slots], width)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    kv = [(torch.randn(len(lengths), k.shape[1], width, k.shape[3], generator=g),) * 2 for k in cache.k]
    cache.write(slots, kv, pos, valid)


def _attend(q, past, mask):
    k, v = past
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def test_sliding_read_stops_at_the_longest_row_while_no_row_fills_the_ring():
    cfg = build_tiny().cfg
    cache = KVCache(cfg, 2, 64, torch.float32)  # ring = window - 1 = 5 slots
    _fill(cache, [3, 2])
    past, meta = cache.read(torch.arange(2))
    assert past[SLIDING][0].shape[2] == 3 and past[GLOBAL][0].shape[2] == 3
    assert meta["sliding_attention"].valid.tolist() == [[True] * 3, [True, True, False]]
    assert torch.equal(past[SLIDING][0], cache.k[SLIDING][:, :, :3])

    _fill(cache, [4, 4], seed=1)  # row 0 at 7 tokens wraps the ring: the whole ring is read again
    past, meta = cache.read(torch.arange(2))
    assert past[SLIDING][0].shape[2] == cache.ring == 5 and past[GLOBAL][0].shape[2] == 7
    assert meta["sliding_attention"].positions.tolist() == [[5, 6, 2, 3, 4], [5, 1, 2, 3, 4]]


def test_attention_over_the_trimmed_ring_equals_attention_over_the_whole_ring():
    """The slots left out hold no token (masked either way), so the output is the same up to rounding; a
    batch of equal lengths then needs no sliding mask at all."""
    cfg = build_tiny().cfg
    cache = KVCache(cfg, 2, 64, torch.float64)
    _fill(cache, [3, 2])
    slots = torch.arange(2)
    past, meta = cache.read(slots)
    qpos = canvas_positions(cache.lengths[slots], 4)
    ones = torch.ones_like(qpos, dtype=torch.bool)
    mask = attention_masks(qpos, ones, meta, False, cache.window)["sliding_attention"]
    whole = (cache.k[SLIDING], cache.v[SLIDING])
    ring_pos = cache.ring_pos
    whole_mask = attention_masks(
        qpos, ones, {**meta, "sliding_attention": KeyMeta(ring_pos, ring_pos >= 0)},
        False, cache.window,
    )["sliding_attention"]  # fmt: skip
    g = torch.Generator().manual_seed(2)
    new = torch.randn(
        2, cache.k[SLIDING].shape[1], 4, cache.k[SLIDING].shape[3], generator=g, dtype=torch.float64
    )
    q = torch.randn(2, cfg.num_attention_heads, 4, new.shape[3], generator=g, dtype=torch.float64)
    cat = lambda p: (torch.cat([p[0], new], 2), torch.cat([p[1], new], 2))
    assert whole[0].shape[2] == 5 and past[SLIDING][0].shape[2] == 3
    torch.testing.assert_close(_attend(q, cat(past[SLIDING]), mask), _attend(q, cat(whole), whole_mask))

    equal = KVCache(cfg, 2, 64, torch.float32)
    _fill(equal, [3, 3])
    _, meta = equal.read(slots)
    qpos = canvas_positions(equal.lengths[slots], 4)
    masks = attention_masks(qpos, torch.ones_like(qpos, dtype=torch.bool), meta, False, equal.window)
    assert masks["sliding_attention"] is None and masks["full_attention"] is None
