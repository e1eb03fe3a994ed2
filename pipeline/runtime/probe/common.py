"""What the load-time probes share: how a kernel's output is held to its reference (bit patterns, E4M3
codes, bounds from the roundings two correct forms may differ by), the values over seven decades the
probes feed, the dtypes they run in, and the message a failed form leaves."""

from __future__ import annotations

import torch

# Triton compiles a kernel anew for each dtype of its tensors, so a kernel is probed in every dtype a load can
# hand it: the float dtypes a model loads in, for kernels that take any float input (the LM head's logits,
# the activations the one-pass quantizations read); bf16 and fp16 for those whose `*_serves` admits those
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
HALF_FLOATS = (torch.bfloat16, torch.float16)
# what a failed Triton form's error tells the operator
TRITON_FALLBACK = "dgpipe uses the dispatch row's other path; report the GPU, torch and Triton versions"


def fp8_codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two E4M3 tensors hold the same codes, NaN's sign aside (torch keeps the input's, the hardware
    conversion writes the canonical 0x7F; a NaN activation is NaN downstream either way)."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative L2 distance of `got` from the float reference `want`: a rounding apart is a few 1e-3, a
    wrong kernel O(1)."""
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-30))


def spread(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Probe values [rows, cols]: normal draws scaled over seven decades along each row (1e-3 to 1e4), clamped
    to fp16's range so one draw serves bf16 and fp16."""
    return (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 4, cols)).clamp(-6e4, 6e4)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two bf16/fp16 tensors hold the same bit patterns (NaN, infinities and -0.0 included)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def same_layer_end(
    got: torch.Tensor, want: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor
) -> bool:
    """Whether two layer ends agree as closely as RMSNorms summing their squares in another order let them:
    within 2^-6 of the value plus 2^-6 of the scaled residual it was summed from (a norm's output a unit of
    2^-7 off, which the residual sum can leave as the whole result where the two cancel), and NaN where the
    other has NaN. A wrong weight, eps or rounding step is off by far more."""
    return within(got, want, 2.0**-6 * (want.float().abs() + (residual.float() * scale.float()).abs()))


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> bool:
    """got within `bound` of want, or equal (infinities), and NaN where want has NaN."""
    g, w = got.float(), want.float()
    close = ((g - w).abs() <= bound) | (g == w)
    return bool(torch.equal(g.isnan(), w.isnan()) and (close | w.isnan()).all())
