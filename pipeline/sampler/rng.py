"""Stateless counter-based random numbers keyed by (seed, request, canvas, step, position, stream).

Why not torch.Generator: a request's draws must not depend on which other requests share its batch, on
how many steps its neighbours took, or on the device. A pure hash of the coordinates gives that, and the
CUDA sampler kernel computes the very same function (see `csrc/`), so CPU and GPU sample identically.

The hash is murmur3's 32-bit finalizer chained over the key words. Arithmetic is done in int32, whose
add, multiply and left shift wrap modulo 2**32 exactly as uint32 arithmetic in C does (torch has no
uint32 shifts on CPU); only the right shift differs (int32's is arithmetic), so `_shr` masks off the
copied sign bits. int32 keeps 8 lanes per AVX2 register and has a native multiply, where int64-and-mask
had 4 lanes and an emulated one. The public functions take and return int64 tensors holding uint32
values, as the CUDA header and the ONNX functions state them.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9

STREAM_INIT = 0  # initial canvas tokens
STREAM_SAMPLE = 1  # Gumbel noise for sampling the denoiser distribution
STREAM_RENOISE = 2  # replacement tokens for positions that were not kept


def _i32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


_M1, _M2, _GOLDEN = _i32(0x85EBCA6B), _i32(0xC2B2AE35), _i32(GOLDEN)


def to_i32(x: torch.Tensor | int) -> torch.Tensor:
    """Low 32 bits of an integer tensor (any sign, any width) as int32."""
    v = torch.as_tensor(x).to(torch.int64) & MASK32
    return (v - ((v >> 31) << 32)).to(torch.int32)  # in int32 range before the cast: no overflow


def to_u32(x: torch.Tensor) -> torch.Tensor:
    """int32 bits back to their uint32 value, held in int64."""
    return x.to(torch.int64) & MASK32


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int32 bits (uint32 `x >> k`)."""
    return (x >> k) & ((1 << (32 - k)) - 1)


def fmix32_(x: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 in place on an int32 tensor."""
    x ^= _shr(x, 16)
    x *= _M1
    x ^= _shr(x, 13)
    x *= _M2
    x ^= _shr(x, 16)
    return x


def combine_salt(h: torch.Tensor) -> torch.Tensor:
    """The part of `combine(h, word)` that does not depend on the word: GOLDEN + (h << 6) + (h >> 2)."""
    return (h << 6) + _shr(h, 2) + _GOLDEN


def combine_i32(h: torch.Tensor, word: torch.Tensor | int) -> torch.Tensor:
    """combine() on int32 bits (broadcasting); returns a new tensor."""
    return fmix32_(h ^ (combine_salt(h) + word))


def fmix32(x: torch.Tensor) -> torch.Tensor:
    return to_u32(fmix32_(to_i32(x)))


def combine(h: torch.Tensor, word: torch.Tensor | int) -> torch.Tensor:
    """h' = fmix32(h ^ (word + GOLDEN + (h << 6) + (h >> 2))): boost-style combine, order-sensitive."""
    w = to_i32(word) if isinstance(word, torch.Tensor) else _i32(word & MASK32)
    return to_u32(combine_i32(to_i32(h), w))


HOST_KEY_ROWS = 64  # up to this many CPU rows, key_hash runs on Python ints (see key_hash)


def _fmix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def _combine_int(h: int, word: int) -> int:
    return _fmix32_int(h ^ ((word + GOLDEN + (h << 6) + (h >> 2)) & MASK32))


def _key_hash_host(words: list[list[int]], stream: int) -> list[int]:
    """key_hash on Python ints, one row at a time: the same uint32 function."""
    out = []
    for seed, *rest in zip(*words, strict=True):
        h = _fmix32_int(seed & MASK32)
        if hi := (seed >> 32) & MASK32:
            h = _combine_int(h, hi)
        for w in rest:
            h = _combine_int(h, w & MASK32)
        out.append(_combine_int(h, stream & MASK32))
    return out


def key_hash(
    seed: torch.Tensor, request: torch.Tensor, canvas: torch.Tensor, step: torch.Tensor, stream: int
) -> torch.Tensor:
    """Per-row key [B] (int64 holding uint32) for one (canvas, step, stream).

    A seed's high 32 bits are folded in after its low ones, only where they are not 0: a seed under 2**32
    hashes as a 32-bit one, and seeds that differ above bit 31 (the API takes 63-bit seeds) draw apart.

    A few CPU rows hash on Python ints: the tensor form is ~50 dispatches on [B] tensors (about 0.5 ms,
    twice per denoise step), which is most of the sampler's time on a small model. Never while tracing
    or compiling, where the values would be baked into the graph."""
    words = (seed, request, canvas, step)
    if (
        all(w.device.type == "cpu" and w.dim() == 1 for w in words)
        and seed.numel() <= HOST_KEY_ROWS
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
    ):
        return torch.tensor(_key_hash_host([w.tolist() for w in words], stream), dtype=torch.int64)
    h = fmix32_(to_i32(seed))
    hi = to_i32(seed >> 32)
    h = torch.where(hi != 0, combine_i32(h, hi), h)
    for w in (request, canvas, step):
        h = combine_i32(h, to_i32(w))
    return to_u32(combine_i32(h, stream))


def position_bits_i32(key: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] 32-bit draws, one per canvas position, as int32 bits."""
    pos = torch.arange(length, dtype=torch.int32, device=key.device)
    return combine_i32(to_i32(key)[:, None], pos[None, :])


def position_bits(key: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] 32-bit draws, one per canvas position."""
    return to_u32(position_bits_i32(key, length))


def uniform_tokens(key: torch.Tensor, length: int, vocab_size: int) -> torch.Tensor:
    """[B, L] tokens uniform over the vocabulary (multiply-shift, no modulo bias beyond 2**-32)."""
    return (position_bits(key, length) * vocab_size) >> 32


def gumbel_rows_(
    pos_key: torch.Tensor, vocab_ids: torch.Tensor, out: torch.Tensor, bits: torch.Tensor
) -> None:
    """log(-log(u)) = -g for rows of positions: pos_key [R] int32, vocab_ids [V] int32 -> out [R, V] fp32.
    `bits` [R, V] int32 is scratch. The same fp32 operations as `gumbel`, in place (so bit-identical)."""
    torch.add(vocab_ids[None, :], combine_salt(pos_key)[:, None], out=bits)
    bits ^= pos_key[:, None]
    # fmix32_ with `out`'s storage as the shift scratch: no [R, V] temporaries (at 1 MiB a block, each
    # would be a fresh mmap and page faults on every step)
    tmp = out.view(torch.int32)
    for shift, mult in ((16, _M1), (13, _M2), (16, None)):
        torch.bitwise_right_shift(bits, shift, out=tmp)
        tmp &= (1 << (32 - shift)) - 1
        bits ^= tmp
        if mult is not None:
            bits *= mult
    bits >>= 9
    bits &= (1 << 23) - 1
    # u = (r + 0.5) * 2**-23 as r * 2**-23 + 2**-24: both exact in fp32 (r < 2**23), so the same u with the
    # int -> float conversion folded into the multiply (one pass less)
    torch.mul(bits, 1.0 / (1 << 23), out=out)
    out.add_(1.0 / (1 << 24)).log_().neg_().log_()


def gumbel(key: torch.Tensor, length: int, vocab_size: int, vocab_chunk: int = 1 << 16) -> torch.Tensor:
    """[B, L, V] fp32 standard Gumbel noise. u = (r + 0.5) * 2**-23 with 23 random bits: every value is
    exact in fp32 and strictly inside (0, 1). (24 bits would round (2**24 - 1) + 0.5 up to 2**24, u = 1,
    g = +inf: one token in 2**24, i.e. one position in 64 at vocab 262144, sampled uniformly.)"""
    pos_key = position_bits_i32(key, length)  # [B, L]
    out = torch.empty(*pos_key.shape, vocab_size, dtype=torch.float32, device=key.device)
    for start in range(0, vocab_size, vocab_chunk):
        v = torch.arange(start, min(start + vocab_chunk, vocab_size), dtype=torch.int32, device=key.device)
        bits = _shr(combine_i32(pos_key[..., None], v), 9)
        u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))
        out[..., start : start + v.numel()] = -torch.log(-torch.log(u))
    return out
