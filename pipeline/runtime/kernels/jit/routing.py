"""The Triton kernels of `pipeline.runtime.kernels.routing` (imported on first use; see there)."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit(do_not_specialize=["tokens"])  # token counts: one binary for every length
def top_k(
    scores_ptr,
    scale_ptr,
    w_ptr,
    i_ptr,
    tokens,
    E: tl.constexpr,
    K: tl.constexpr,
    E_P2: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """For each token's router scores [E]: the softmax in fp32 (exp(s - max) / sum, CUDA's expf and an
    IEEE division, as torch's CUDA softmax computes it), its K largest probabilities in descending order (the
    lower expert first where two are equal), renormalised to sum to 1 and times their experts' scales. The
    choice is made on a key that ranks NaN above every number, as `torch.topk` does, and the padding columns
    below everything: a row with a NaN or infinite score (all its probabilities NaN) still gets K distinct
    experts below E, where `tl.argmax` over the NaN probabilities would pick whichever column its reduction
    order left, K times, past E where E is not a power of two."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P2)
    rows = t < tokens
    s = tl.load(scores_ptr + t[:, None] * E + e[None, :], mask=rows[:, None] & (e < E)[None, :], other=0.0)
    s = tl.where((e < E)[None, :], s.to(tl.float32), float("-inf"))
    x = libdevice.exp(s - tl.max(s, axis=1)[:, None])
    p = tl.math.div_rn(x, tl.sum(x, axis=1)[:, None])
    j = tl.arange(0, K_P2)[None, :]
    w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
    idx = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
    key = tl.where(p != p, 2.0, p)  # probabilities are in [0, 1]: NaN first
    key = tl.where((e < E)[None, :], key, -2.0)
    for k in tl.static_range(K):
        best = tl.argmax(key, axis=1, tie_break_left=True)
        chosen = e[None, :] == best[:, None]
        w = tl.where(j == k, tl.sum(tl.where(chosen, p, 0.0), axis=1)[:, None], w)
        idx = tl.where(j == k, best[:, None], idx)
        key = tl.where(chosen, -3.0, key)  # never chosen again
    w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None])
    out = t[:, None] * K + j
    inside = rows[:, None] & (j < K)
    w = w * tl.load(scale_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    tl.store(w_ptr + out, w, mask=inside)
    tl.store(i_ptr + out, idx.to(tl.int64), mask=inside)


@triton.jit(do_not_specialize=["tokens"])  # token counts: one binary for every length
def expert_order(
    index_ptr,
    order_ptr,
    token_ptr,
    offs_ptr,
    rows_ptr,
    tokens,
    K: tl.constexpr,
    COUNT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program e: the routed slots (token * K + choice) that chose expert e, in increasing slot order, written
    where a stable sort of the slots by expert puts them (after every slot of a lower expert), with their
    tokens, and each such slot's sorted position (the order's inverse); and expert e's end offset. Two sweeps over the slots' experts: the count of lower ones, then the
    running rank of e's own."""
    e = tl.program_id(0)
    slots = tokens * K  # a multiple of K whatever the token count: the loads below stay vectorized
    lower = tl.full((), 0, tl.int32)
    for start in range(0, slots, COUNT):
        i = start + tl.arange(0, COUNT)
        x = tl.load(index_ptr + i, mask=i < slots, other=0)
        lower += tl.sum(((x < e) & (i < slots)).to(tl.int32), axis=0)
    end = lower
    for start in range(0, slots, CHUNK):
        i = start + tl.arange(0, CHUNK)
        hit = tl.load(index_ptr + i, mask=i < slots, other=-1) == e
        dst = end + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(order_ptr + dst, i.to(tl.int64), mask=hit)
        tl.store(token_ptr + dst, (i // K).to(tl.int64), mask=hit)
        tl.store(rows_ptr + i, dst.to(tl.int64), mask=hit)
        end += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(offs_ptr + e, end)
