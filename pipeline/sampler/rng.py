"""Stateless counter-based random numbers keyed by (seed, request, canvas, step, position, stream).

Why not torch.Generator: a request's draws must not depend on which other requests share its batch, on
how many steps its neighbours took, or on the device. A pure hash of the coordinates gives that, and the
CUDA sampler kernel computes the very same function (see `csrc/`), so CPU and GPU sample identically.

The hash is murmur3's 32-bit finalizer chained over the key words. Arithmetic is done in int64 with
explicit masking so that it is exact on every torch backend (int64 multiply wraps modulo 2**64, and we
keep only the low 32 bits, which is what uint32 arithmetic in C does).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9

STREAM_INIT = 0  # initial canvas tokens
STREAM_SAMPLE = 1  # Gumbel noise for sampling the denoiser distribution
STREAM_RENOISE = 2  # replacement tokens for positions that were not kept


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def combine(h: torch.Tensor, word: torch.Tensor | int) -> torch.Tensor:
    """h' = fmix32(h ^ (word + GOLDEN + (h << 6) + (h >> 2))): boost-style combine, order-sensitive."""
    return fmix32(h ^ ((word + GOLDEN + ((h << 6) & MASK32) + (h >> 2)) & MASK32))


def key_hash(
    seed: torch.Tensor, request: torch.Tensor, canvas: torch.Tensor, step: torch.Tensor, stream: int
) -> torch.Tensor:
    """Per-row key [B] (int64 holding uint32) for one (canvas, step, stream)."""
    h = fmix32(seed.to(torch.int64) & MASK32)
    for w in (request, canvas, step):
        h = combine(h, w.to(torch.int64) & MASK32)
    return combine(h, stream)


def position_bits(key: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] 32-bit draws, one per canvas position."""
    pos = torch.arange(length, dtype=torch.int64, device=key.device)
    return combine(key[:, None], pos[None, :])


def uniform_tokens(key: torch.Tensor, length: int, vocab_size: int) -> torch.Tensor:
    """[B, L] tokens uniform over the vocabulary (multiply-shift, no modulo bias beyond 2**-32)."""
    return (position_bits(key, length) * vocab_size) >> 32


def gumbel(key: torch.Tensor, length: int, vocab_size: int, vocab_chunk: int = 1 << 16) -> torch.Tensor:
    """[B, L, V] fp32 standard Gumbel noise. u = (r + 0.5) * 2**-23 with 23 random bits: every value is
    exact in fp32 and strictly inside (0, 1). (24 bits would round (2**24 - 1) + 0.5 up to 2**24, u = 1,
    g = +inf: one token in 2**24, i.e. one position in 64 at vocab 262144, sampled uniformly.)"""
    pos_key = position_bits(key, length)  # [B, L]
    out = torch.empty(*pos_key.shape, vocab_size, dtype=torch.float32, device=key.device)
    for start in range(0, vocab_size, vocab_chunk):
        v = torch.arange(start, min(start + vocab_chunk, vocab_size), dtype=torch.int64, device=key.device)
        bits = combine(pos_key[..., None], v)
        u = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
        out[..., start : start + v.numel()] = -torch.log(-torch.log(u))
    return out
