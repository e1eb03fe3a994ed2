"""The KV cache's read: a sliding layer's ring is read only as far as it holds tokens, and attention over
that read equals attention over the whole ring."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.network import PastWithRoom, canvas_positions
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


def test_a_read_with_room_hands_out_the_buffers_past_the_tokens_and_never_over_them():
    """Rows that are a range of the cache get each layer's cached K/V with room after them for a canvas:
    views of the buffers, the room past every row's length and, in a ring, in slots no held position maps
    to (before the ring fills: past its longest row; after: the slots beyond it). Rows gathered out of order
    or a canvas that does not fit get the K/V alone, as without room."""
    cfg = build_tiny().cfg
    cache = KVCache(cfg, 3, 16, torch.float32, room=4)  # ring of 5 slots, 4 more for a canvas
    assert cache.k[SLIDING].shape[2] == cache.ring + 4 and cache.k[GLOBAL].shape[2] == 16
    _fill(cache, [3, 2, 1])
    rows = torch.arange(2)
    past, meta = cache.read(rows, room=4)
    for layer, held in ((SLIDING, 3), (GLOBAL, 3)):
        p = past[layer]
        assert isinstance(p, PastWithRoom) and p.length == held and p.k.shape[2] == held + 4
        assert p.k.data_ptr() == cache.k[layer].data_ptr() and p.v.data_ptr() == cache.v[layer].data_ptr()
    assert meta["full_attention"].positions.shape[1] == 3  # the keys' positions: the tokens only
    # a canvas written into the room changes no token a later read returns
    before = [(k.clone(), v.clone()) for k, v in cache.read(rows)[0]]  # a read of a range is a view
    for p in past:
        p.k[:, :, p.length :] = 7.0
        p.v[:, :, p.length :] = 7.0
    after, _ = cache.read(rows)
    for layer in (SLIDING, GLOBAL):
        for row, tokens in ((0, 3), (1, 2)):
            for kv in (0, 1):  # K, then V: [rows, heads, tokens, head_dim]
                held = before[layer][kv][row, :, :tokens]
                assert (held != 7.0).all() and torch.equal(held, after[layer][kv][row, :, :tokens])
    _fill(cache, [4, 4, 0], seed=1)  # row 0 at 7 tokens wraps the ring: the room is past it
    past, _ = cache.read(rows, room=4)
    assert past[SLIDING].length == cache.ring and past[SLIDING].k.shape[2] == cache.ring + 4
    # no room: rows out of order (a gathered copy), a canvas past the context, no room asked for
    assert not isinstance(cache.read(torch.tensor([1, 0]), room=4)[0][SLIDING], PastWithRoom)
    assert not isinstance(cache.read(rows, room=16 - 7 + 1)[0][GLOBAL], PastWithRoom)
    assert not isinstance(cache.read(rows)[0][GLOBAL], PastWithRoom)


def test_a_denoise_pass_over_the_room_is_the_pass_over_concatenated_k_v():
    """The tiny model's denoise pass reading its cache with room (the canvas's K/V written into the buffers,
    attention over them in place) gives the logits of the pass that concatenates, bit for bit, and leaves
    the tokens the cache holds as they were."""
    model = build_tiny().eval()
    cfg, length = model.cfg, 8
    cache = KVCache(cfg, 2, 64, torch.float32, room=length)
    slots = torch.arange(2)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, cfg.vocab_size, (2, 7), generator=g)
    pos = canvas_positions(cache.lengths[slots], 7)
    valid = torch.arange(7)[None, :] < torch.tensor([7, 5])[:, None]  # rows of different lengths
    with torch.inference_mode():
        cache.write(
            slots,
            model.encode_kv(prompt, pos, attention_masks(pos, valid, None, True, cache.window)),
            pos,
            valid,
        )
        canvas = torch.randint(2, cfg.vocab_size, (2, length), generator=g)
        cpos = canvas_positions(cache.lengths[slots], length)
        plain, meta = cache.read(slots)
        masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, cache.window)
        want = model.denoise(canvas, None, cpos, masks, plain)
        held = [(k.clone(), v.clone()) for k, v in plain]
        roomy, _ = cache.read(slots, room=length)
        assert all(isinstance(p, PastWithRoom) for p in roomy)
        got = model.denoise(canvas, None, cpos, masks, roomy)
        again, _ = cache.read(slots)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for kv, kv_held in zip(again, held) for a, b in zip(kv, kv_held))


def test_a_write_past_the_last_slot_is_refused_and_a_write_up_to_it_is_not():
    """Writing more tokens than a row's slots raises instead of indexing past the buffer (on a GPU an
    out-of-bounds write corrupts another request's K/V or faults the device); filling every slot exactly is
    fine, and the refused write changes nothing."""
    cache = KVCache(build_tiny().cfg, 2, 16, torch.float32)
    _fill(cache, [16, 3])  # row 0 holds max_len tokens: full, not over
    assert cache.lengths.tolist() == [16, 3]
    with pytest.raises(ValueError, match=r"KV cache overflow: 17 tokens > 16 slots"):
        _fill(cache, [1, 1])
    assert cache.lengths.tolist() == [16, 3]
    fresh = KVCache(build_tiny().cfg, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="overflow"):
        _fill(fresh, [17])
