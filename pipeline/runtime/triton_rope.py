"""RoPE in one Triton kernel per tensor on CUDA: what `pipeline.model.network.apply_rope` computes, value for
value.

Eagerly, rotating q or k is five element-wise kernels (x * cos, the negation and concatenation of
`rotate_half`, its product with sin, the sum), each a pass through memory: ten launches a layer for q and
k, ~300 of the ~2,100 in one FP8 26B pass (`dgpipe bench gpu-trace`), a few microseconds each even inside a
CUDA graph. One program here rotates a block of (token, head) rows, reading x and its token's cos/sin
once. Each product and the sum are rounded to x's dtype exactly where torch's kernels round them (a product
of two bf16 or fp16 values is exact in fp32), so the result is torch's bit for bit: the unit tests hold it
to the torch form in Triton's interpreter (with round-to-nearest-even casts) and compile it for sm_90a,
sm_100a, sm_89 and sm_120 with no fused multiply-add (`OPTIONS`); the load-time probe holds it to the torch
form on the GPU before a model uses it (`pipeline.runtime.probe.check_triton_rope`). bf16 and fp16 only.
Under torch.compile the torch form stays (inductor fuses it).
"""

from __future__ import annotations

import functools

import torch

from pipeline.model.network import apply_rope

ROW_VALUES = 4096  # values per program: 16 rows of a 256-wide head, 8 of a 512-wide one
# no floating-point contraction: with it (Triton's default) LLVM turns a product and the sum it feeds into
# one fused multiply-add, rounding once where torch rounds twice (seen in the PTX for sm_90a: fma.rn.bf16)
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    """The jitted kernel, imported on first use (Triton reads TRITON_INTERPRET when `jit` wraps it)."""
    from pipeline.runtime import triton_rope_kernels

    return triton_rope_kernels


def serves(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes x [B, L, H, D] with cos/sin [B, L, D]: bf16/fp16, D even, all contiguous and
    of one dtype (anything else keeps the torch form)."""
    d = x.shape[-1]
    return (
        x.dtype in DTYPES
        and cos.dtype == x.dtype
        and x.dim() == 4
        and cos.shape == (*x.shape[:2], d)
        and d % 2 == 0
        and x.is_contiguous()
        and cos.is_contiguous()
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D] rotated by cos/sin [B, L, D] (`serves` must hold): x * cos + rotate_half(x) * sin."""
    import triton

    out = torch.empty_like(x)
    rows, d = x.numel() // x.shape[-1], x.shape[-1]
    if rows:
        half = triton.next_power_of_2(d // 2)
        block = max(1, ROW_VALUES // (2 * half))
        _kernels().rope[(triton.cdiv(rows, block),)](
            x, cos, sin, out, rows, x.shape[2], HALF=d // 2, HALF_P2=half, BLOCK_R=block, **OPTIONS
        )
    return out


def rope_or_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope` where it `serves`, else the torch form: what the GPU loader installs as the layers' RoPE."""
    return rope(x, cos, sin) if serves(x, cos) else apply_rope(x, cos, sin)
