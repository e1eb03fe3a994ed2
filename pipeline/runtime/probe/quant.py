"""The probes of the one-pass activation quantizations (`kernels.quant`): FP8, NVFP4 codes and block
scales, their swizzles, and the Hopper/Ada fallback's per-row FP8 of NVFP4-rounded rows, bit for bit
against torch's forms."""

from __future__ import annotations

import torch

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.runtime import kernels
from pipeline.runtime.probe.common import (
    FLOATS,
    TRITON_FALLBACK,
    fp8_codes_equal,
)
from pipeline.runtime.tensor_cores import quantize_rows

# normal, subnormal, tie, saturating and non-finite activations (before the probe's scale of 0.5)
QUANT_PROBE_VALUES = (
    0.0,
    1e-9,
    2.0**-10,
    2.0**-9 * 1.5,
    0.3,
    0.3125,
    1.0625,
    224.0,
    232.5,
    1e6,
    float("inf"),
    float("nan"),
)


def check_triton_fp8_quant(dev: torch.device) -> None:
    """dgpipe's one-pass FP8 quantization bit for bit against torch's three passes on normal, subnormal,
    tie, out-of-range and non-finite values, in each of `FLOATS`, or a DgpipeError."""
    v = torch.tensor(QUANT_PROBE_VALUES)
    v = torch.cat([v, -v, torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 64])
    scale = torch.tensor(0.5, device=dev)
    for dtype in FLOATS:
        x = v.to(dev, dtype)
        if not fp8_codes_equal(kernels.quant.fp8(x, scale), sl.fp8_quantize(x, scale)):
            raise DgpipeError(f"the Triton fp8 activation quantization differs from torch's ({dtype})",
                              TRITON_FALLBACK)  # fmt: skip


def nvfp4_probe_rows(dev: torch.device) -> torch.Tensor:
    """bf16 rows [8, 176] (11 blocks of 16) through every case of NVFP4 rounding at global scale 0.5: in
    two blocks whose scale decodes to exactly 0.5, each E2M1 decision point and its bf16 neighbours below and
    above; blocks all zero, too small for a scale, with subnormal scales; NaN and infinities; random rows
    over eight decades."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(8, 176, generator=g) * torch.logspace(-4, 4, 8)[:, None]
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.bfloat16)
    for block, toward in enumerate((0.0, 9.0)):  # the block maximum 6 (x = 3) gives scale 6 / 6 * 0.5
        near = points.nextafter(torch.tensor(toward, dtype=torch.bfloat16))
        values = torch.cat([points, near, torch.tensor([6.0, 0.0], dtype=torch.bfloat16)])
        rows[0, 16 * block : 16 * block + 16] = (values / 2).float()
    rows[1, :16], rows[1, 16:32], rows[1, 32:48] = 0.0, 1e-30, 2.0**-14
    rows[2, 3], rows[2, 40], rows[2, 70] = float("nan"), float("inf"), -float("inf")
    return rows.to(dev, torch.bfloat16)


def nvfp4_quant_rows(dev: torch.device) -> torch.Tensor:
    """The NVFP4 quantizations' probe rows: `nvfp4_probe_rows` and their negations in another order (no
    palindrome, so a swizzle of the rows reversed shows), 176 blocks of 16: more than one program of the
    one-pass kernel."""
    rows = nvfp4_probe_rows(dev)
    return torch.cat([rows, -rows.roll(3, 0)])


def check_triton_quant(mode: str, dev: torch.device) -> None:
    """dgpipe's one-pass activation quantization bit for bit against torch's form, in each of `FLOATS`, or a
    DgpipeError. `mode` "fp8": `check_triton_fp8_quant`. "nvfp4": codes and block scales, also with the
    scales swizzled for a linear, and the scales' swizzle for grouped rows, with and without their gather.
    "fp8_rowwise": NVFP4 rounding, then per-row E4M3. NVFP4 on `nvfp4_quant_rows`."""
    if mode == "fp8":
        return check_triton_fp8_quant(dev)
    rows, gs = nvfp4_quant_rows(dev), torch.tensor(0.5, device=dev)
    kernel = kernels.quant.nvfp4 if mode == "nvfp4" else kernels.quant.nvfp4_fp8_rows
    for dtype in FLOATS:
        x = rows.to(dtype)
        (q, s), (want_q, want_s) = kernel(x, gs), quantize_rows(x, gs, mode)
        if mode == "nvfp4":
            q_blocked, s_blocked = kernels.quant.nvfp4_blocked(x, gs)  # rows and scale columns padded
            raw = want_s.view(torch.uint8)
            same = (
                torch.equal(q, want_q)
                and fp8_codes_equal(s, want_s)
                and torch.equal(q_blocked, want_q)
                and fp8_codes_equal(s_blocked, sl.to_blocked(raw))
            )
        else:
            same = fp8_codes_equal(q, want_q) and torch.equal(s, want_s)
        if not same:
            raise DgpipeError(f"the Triton {mode} activation quantization differs from torch's ({dtype})",
                              TRITON_FALLBACK)  # fmt: skip
    if mode == "nvfp4" and not same_grouped_swizzle(raw):
        raise DgpipeError("the Triton swizzle of grouped NVFP4 scales differs from torch's", TRITON_FALLBACK)


def same_grouped_swizzle(raw: torch.Tensor) -> bool:
    """`kernels.quant.blocked_scales` of NVFP4 block scales `raw` [16, C] (uint8) in three groups, one of
    them empty, as they are and gathered to an expert order (repeats included), byte for byte what
    `scaled_layout.to_blocked_grouped` makes of them."""
    offs = torch.tensor([3, 3, len(raw)], dtype=torch.int32, device=raw.device)
    rows = torch.tensor([7, 0, 0, 5, 2, 7, 1, 3, 12, 15, 9, 9, 4, 6, 8, 10], device=raw.device)
    return torch.equal(
        kernels.quant.blocked_scales(raw, offs), sl.to_blocked_grouped(raw, offs)
    ) and torch.equal(kernels.quant.blocked_scales(raw, offs, rows), sl.to_blocked_grouped(raw[rows], offs))
