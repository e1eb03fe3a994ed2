"""The int32 counter RNG and the cache-blocked sampler step against their straightforward statements."""

from __future__ import annotations

import pytest
import torch

from pipeline.sampler import rng
from pipeline.sampler.fused import sample_step_fused
from pipeline.sampler.reference import CounterDraws, RowKeys, sample_step

M = 0xFFFFFFFF


# ---- the hash as it was first written: uint32 emulated in int64 with explicit masks -----------------
def fmix32_i64(x):
    x = x & M
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M
    return x ^ (x >> 16)


def combine_i64(h, w):
    return fmix32_i64(h ^ ((w + rng.GOLDEN + ((h << 6) & M) + (h >> 2)) & M))


def key_hash_i64(seed, request, canvas, step, stream):
    h = fmix32_i64(seed & M)
    hi = (seed >> 32) & M  # the seed's high word, folded in only where set
    h = torch.where(hi != 0, combine_i64(h, hi), h)
    for w in (request, canvas, step):
        h = combine_i64(h, w & M)
    return combine_i64(h, stream)


def gumbel_i64(key, length, vocab):
    pos = combine_i64(key[:, None], torch.arange(length))
    bits = combine_i64(pos[..., None], torch.arange(vocab))
    return -torch.log(-torch.log(((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))))


def big_ints(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-(2**62), 2**62, (n,), generator=g)
    x[:8] = torch.tensor([0, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -(2**31), -(2**31) - 1])
    return x


def test_int32_hash_equals_int64_statement():
    x, y = big_ints(20_000, 0), big_ints(20_000, 1)
    assert torch.equal(rng.fmix32(x), fmix32_i64(x))
    assert torch.equal(rng.combine(x, y), combine_i64(x & M, y & M))
    assert torch.equal(rng.combine(x, 5), combine_i64(x & M, 5))
    a, b, c, d = x[:64], y[:64], x[64:128], y[64:128]
    for stream in (rng.STREAM_INIT, rng.STREAM_SAMPLE, rng.STREAM_RENOISE):
        assert torch.equal(rng.key_hash(a, b, c, d, stream), key_hash_i64(a, b, c, d, stream))
    keys = rng.key_hash(a, b, c, d, rng.STREAM_RENOISE)
    pos = combine_i64(keys[:, None], torch.arange(300))
    assert torch.equal(rng.position_bits(keys, 300), pos)
    for vocab in (262_144, 1000, 7, 2**31 - 1):
        assert torch.equal(rng.uniform_tokens(keys, 300, vocab), (pos * vocab) >> 32)


def test_key_hash_host_and_tensor_forms_agree():
    """key_hash takes Python ints up to HOST_KEY_ROWS CPU rows, tensors above: both are the statement."""
    x, y = big_ints(2 * 200, 2), big_ints(2 * 200, 3)
    for rows in (1, rng.HOST_KEY_ROWS, rng.HOST_KEY_ROWS + 1, 200):
        a, b, c, d = x[:rows], y[:rows], x[200 : 200 + rows], y[200 : 200 + rows]
        for stream in (rng.STREAM_INIT, rng.STREAM_SAMPLE, rng.STREAM_RENOISE):
            got = rng.key_hash(a, b, c, d, stream)
            assert got.dtype == torch.int64 and got.shape == (rows,)
            assert torch.equal(got, key_hash_i64(a, b, c, d, stream))


def test_int32_gumbel_is_bit_identical():
    keys = torch.tensor([501821951, 0, M, 123456789, 2**31])
    ours, ref = rng.gumbel(keys, 9, 3000, vocab_chunk=1024), gumbel_i64(keys, 9, 3000)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


def row_keys(b: int, step: int = 0) -> RowKeys:
    t = lambda v: torch.full((b,), v, dtype=torch.long)
    return RowKeys(t(7), torch.arange(b) * 1000 + 3, t(2), t(step))


def assert_same_step(a, b):
    for f in ("canvas", "argmax", "kept"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in ("probs", "entropy"):  # fp32, bit for bit
        assert torch.equal(getattr(a, f).view(torch.int32), getattr(b, f).view(torch.int32)), f


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch splits a single-output reduction across threads: the bit-identity must hold at any count."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("b", "length", "vocab", "block"),
    [
        (1, 8, 24, 1 << 18),
        (3, 17, 1000, 4000),
        (2, 32, 5003, 5003 * 5),
        (2, 16, 40_000, 1),  # one row per block asked for: blocks still hold 2
        (1, 7, 40_000, 3 * 40_000),  # 3-row blocks with a 1-row tail folded into the last block
    ],
)
def test_fused_step_is_bit_identical_to_the_reference(b, length, vocab, block, threads):
    g = torch.Generator().manual_seed(vocab)
    scale = torch.linspace(0.5, 8.0, length)[None, :, None]  # flat to peaked rows
    logits = 30 * torch.tanh(torch.randn(b, length, vocab, generator=g) * scale / 30)
    logits[0, 0, :5] = logits[0, 0].max()  # a tie: the first index wins in both
    temp = torch.linspace(0.4, 0.8, b)
    bound = torch.linspace(0.05, 20.0, b)
    tpl = torch.full((b, length), -1)
    tpl[:, 1::4] = 3
    for template in (None, tpl):
        for step in (0, 5):
            keys = row_keys(b, step)
            ref = sample_step(logits, temp, bound, keys, CounterDraws(), template)
            assert_same_step(
                sample_step_fused(logits, temp, bound, keys, template, block_elements=block), ref
            )


def test_reused_probs_buffer_gives_the_same_step():
    """A caller's probs buffer (the runtime's, reused step to step) changes no value and is what is returned."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 40, 300, generator=g) * 4
    temperature, bound = torch.tensor([1.0, 0.7]), torch.tensor([0.5, 2.0])
    buf = torch.full((80, 300), float("nan"))
    for step in range(2):
        keys = row_keys(2, step)
        fresh = sample_step_fused(logits, temperature, bound, keys)
        reused = sample_step_fused(logits, temperature, bound, keys, probs_out=buf)
        assert reused.probs.data_ptr() == buf.data_ptr()
        for field in ("canvas", "argmax", "entropy", "probs", "kept"):
            assert torch.equal(getattr(fresh, field), getattr(reused, field)), field


def test_first_argmax_is_torch_argmax_on_ties_infinities_and_nan():
    from pipeline.sampler.fused import first_argmax_

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=g)
    x[0, [3, 700]] = 50.0  # tie: the first wins
    x[1] = float("-inf")  # a fully masked row: index 0, as argmax
    x[1, [10, 20]] = -5.0
    x[2] = float("-inf")
    x[3, 999] = float("inf")
    x[4, [5, 9]] = float("nan")  # argmax answers the first NaN
    x[5] = 0.0
    x[5, 4] = -0.0  # +0 and -0 are equal maxima: the first
    x[6, 0] = 1e30  # the first and the last index
    x[7, 999] = 1e30
    x[8] = torch.tensor(1.0).nextafter(torch.tensor(2.0))
    x[8, 400] = 1.0 + 2 * (x[8, 0] - 1.0)  # one ulp above its neighbours
    out, scratch = torch.empty(9, dtype=torch.long), torch.empty_like(x)
    first_argmax_(x, out, scratch, torch.arange(1000, 0, -1, dtype=torch.float32))
    assert torch.equal(out, torch.argmax(x, dim=-1))
    assert out.tolist() == [3, 10, 0, 999, 5, 0, 0, 999, 400]


def test_gumbel_rows_is_the_gumbel_noise_bit_for_bit():
    """gumbel_rows_ (the fused sampler's in-place form) forms u as r * 2**-23 + 2**-24, the cast folded into
    the multiply, where rng.gumbel states (r + 0.5) * 2**-23: both exact in fp32, so -log(-log(u)) is the
    same bit for bit, over 2.6M draws of keys with high bits and signs."""
    keys = torch.tensor([501821951, 0, -1, 2**31 - 1, -(2**31), 123456789, 7, 2**30])
    length, vocab = 8, 40_000
    want = rng.gumbel(keys, length, vocab).reshape(-1, vocab)
    pos_key = rng.position_bits_i32(keys, length).reshape(-1)
    out = torch.empty(pos_key.numel(), vocab)
    rng.gumbel_rows_(
        pos_key, torch.arange(vocab, dtype=torch.int32), out, torch.empty_like(out, dtype=torch.int32)
    )
    assert torch.equal((-out).view(torch.int32), want.view(torch.int32))
