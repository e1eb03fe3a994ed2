"""dgpipe's Triton kernels that quantize activations for the tensor-core GEMMs, each in one pass over memory.

Eagerly, torch quantizes an activation in many element-wise passes, one kernel each, every one reading and
writing the whole tensor:
* FP8 with a static scale (`scaled_layout.fp8_quantize`): divide, clamp, cast, 19 bytes of traffic per value
  where one pass needs 3; at 16 canvases the 26B's eager FP8 pass on an H200 spent about a quarter of its time
  in such passes;
* NVFP4 (`scaled_layout.nvfp4_quantize`, for B200 and RTX Blackwell's FP4 GEMMs): ~50 ops per input (block
  maxima, scales, seven E2M1 decision points, codes, packing), so ~13,000 launches per 26B pass at any batch
  (`dgpipe bench gpu-trace`);
* NVFP4 re-quantized to FP8 per row (`nvfp4_fake_quant`, then a per-row E4M3 scale: the NVFP4 row of Hopper and
  Ada): ~45 ops per input.
Each kernel here computes the same values as the torch form, code for code: IEEE division (`div.rn`), clamps
that keep NaN, round-to-nearest saturating E4M3 conversion (`cvt.rn.satfinite`), E2M1 rounding by the same
decision points (ties to the even mantissa). Under torch.compile the traced torch forms stay, so inductor can
fuse them into the op that produced the activation. The load-time probe (`pipeline.runtime.probe`) holds each
kernel to its torch form bit for bit on the GPU before it is used; tests run them in Triton's interpreter and
compile them for sm_90a, sm_100a, sm_89 and sm_120 (tests/unit/runtime/kernels/test_quant.py).
"""

from __future__ import annotations

import functools

import torch

from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK

FP8_BLOCK = 2048  # values per program of the FP8 kernel
NVFP4_BLOCKS = 128  # 16-value blocks per program of the NVFP4 kernel


@functools.cache
def _kernels():
    """The jitted kernels (`kernels.jit.quant`), imported on first use: Triton reads TRITON_INTERPRET when
    `jit` wraps a kernel, and the kernels call each other as module globals, which its interpreter needs."""
    from pipeline.runtime.kernels.jit import quant as jit_quant

    return jit_quant


def fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of x / scale, clamped to E4M3's range (one fp32 `scale` for the whole tensor): what
    `scaled_layout.fp8_quantize` computes."""
    import triton

    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    if n:
        _kernels().fp8_static_quant[(triton.cdiv(n, FP8_BLOCK),)](
            x, scale, out, n, E4M3_MAX=E4M3_MAX, BLOCK=FP8_BLOCK
        )
    return out


def nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 codes of x's rows, packed two per byte (uint8 [..., K/2], low nibble the even column), and
    their E4M3 block scales ([..., K/16]): what `scaled_layout.nvfp4_quantize` computes."""
    import triton

    shape = x.shape
    x = x.contiguous()
    blocks = x.numel() // NVFP4_BLOCK
    packed = torch.empty(*shape[:-1], shape[-1] // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*shape[:-1], shape[-1] // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    if blocks:
        _kernels().nvfp4_quant[(triton.cdiv(blocks, NVFP4_BLOCKS),)](
            x, global_scale, packed, scales, blocks, E2M1_MAX=E2M1_MAX, E4M3_MAX=E4M3_MAX, BLOCKS=NVFP4_BLOCKS
        )
    return packed, scales


def nvfp4_blocked(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`nvfp4` of x [M, K] with the block scales written straight into the swizzled layout a linear's FP4
    GEMM reads (`scaled_layout.to_blocked`: flat uint8, rows padded to 128 and scale columns to 4 with
    zeros), in one launch where `nvfp4` and `blocked_scales` take two."""
    import triton

    m, k = x.shape
    x = x.contiguous()
    c = k // NVFP4_BLOCK
    rows, cp = sl.blocked_shape(m, c)
    packed = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    out = torch.empty(rows * cp, dtype=torch.uint8, device=x.device)
    if rows * cp:
        _kernels().nvfp4_quant_blocked[(triton.cdiv(rows * cp, NVFP4_BLOCKS),)](
            x, global_scale, packed, out, m, c, cp, rows * cp, E2M1_MAX=E2M1_MAX, E4M3_MAX=E4M3_MAX,
            BLOCKS=NVFP4_BLOCKS,
        )  # fmt: skip
    return packed, out


def nvfp4_fp8_rows(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded to NVFP4 (`fake_quant.nvfp4_fake_quant`, in x's dtype), then quantized to E4M3 with one
    scale per row: (E4M3 [M, K], fp32 scales [M]), as `tensor_cores.quantize_rows` does for "fp8_rowwise"."""
    import triton

    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _kernels().nvfp4_fp8_rows[(m,)](
            x, global_scale, out, scales, k, x.stride(0), E2M1_MAX=E2M1_MAX, E4M3_MAX=E4M3_MAX,
            NB=triton.next_power_of_2(k // NVFP4_BLOCK), num_warps=8 if k > 4096 else 4,
        )  # fmt: skip
    return out, scales


BLOCKED_ROWS = 4  # scale rows per program of the swizzle kernel (16 spilled registers on sm_100a)


def blocked_scales(
    scales: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """NVFP4 block scales [M, C] (uint8) of rows grouped by the int32 end offsets `offs` (or the rows
    `scales[rows]`, gathered here) in the layout cuBLAS's grouped block-scaled GEMM reads
    (`scaled_layout.to_blocked_grouped`: each group from a 128-row boundary, [blocked_rows_bound, C padded
    to 4]), in one kernel that writes every byte, the padding's zeros included. torch's form is ~30 launches
    a grouped projection (index arithmetic, a scatter), and the gather one more."""
    import triton

    c = scales.shape[1]
    m = scales.shape[0] if rows is None else rows.shape[0]
    cp = sl.blocked_shape(m, c)[1]
    groups = offs.shape[0]
    padded_rows = sl.blocked_rows_bound(m, groups)
    if padded_rows * cp >= 2**31:  # the kernel's indices are int32 (64-bit ones spilled registers on sm_120)
        raise ValueError(f"{padded_rows * cp} swizzled scales: more than the kernel's int32 indices reach")
    out = torch.empty(padded_rows * cp, dtype=torch.uint8, device=scales.device)
    _kernels().blocked_scales[(triton.cdiv(padded_rows, BLOCKED_ROWS),)](
        scales.contiguous(), offs, offs if rows is None else rows, out, padded_rows, c, cp, groups,
        GATHER=rows is not None, G_POW2=triton.next_power_of_2(groups), BLOCK_R=BLOCKED_ROWS,
        BLOCK_C=triton.next_power_of_2(cp),
    )  # fmt: skip
    return out.view(-1, cp)
