"""A model of the FP8 tensor cores' limited accumulation precision, for setting the GPU tests' bounds.

Hopper's FP8 MMA keeps about 14 bits of the running sum (DeepSeek-V3 technical report, section 3.3.2:
"limited to retaining around 14 bits"). Modelled here as: products summed exactly 32 at a time (one MMA's
K), each partial sum added to the accumulator and the result truncated toward zero to `bits` bits below
the larger operand's leading bit. "Promoted" accumulation (torch's and CUTLASS's default for FP8) adds
that accumulator into fp32 every `interval` values of K; "fast" accumulation never does. The model is a
bound-setter, not a bit-exact simulator: the GPU tests assert measured errors under bounds a few times
above what it gives for 13 and 14 bits.
"""

from __future__ import annotations

import torch

MMA_K = 32  # FP8 values of K one Hopper MMA instruction consumes


def truncating_matmul(
    a: torch.Tensor, b: torch.Tensor, bits: int = 14, interval: int | None = None
) -> torch.Tensor:
    """a [M, K] @ b [K, N] (float64 result) with the accumulator truncated to `bits` bits after every MMA,
    promoted into an exact sum every `interval` values of K (None: never, i.e. fast accumulation)."""
    k = a.shape[1]
    step = interval or k
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for start in range(0, k, step):
        acc = torch.zeros_like(out)
        for k0 in range(start, min(start + step, k), MMA_K):
            part = a[:, k0 : k0 + MMA_K].double() @ b[k0 : k0 + MMA_K].double()
            _, exp = torch.frexp(torch.maximum(acc.abs(), part.abs()))
            ulp = torch.ldexp(torch.ones_like(acc), exp - bits)
            acc = torch.trunc((acc + part) / ulp) * ulp
        out += acc
    return out
