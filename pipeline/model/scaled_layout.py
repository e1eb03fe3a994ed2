"""Pure layout converters between ModelOpt's stored tensors and the operands of torch's scaled GEMMs.

`torch.nn.functional.scaled_mm` / `scaled_grouped_mm` (CUDA only) take quantized operands plus decoding
scales described by a `ScalingType` (and, for block scales, a `SwizzleType`). Everything here is plain
tensor arithmetic, so it runs and is tested on the CPU against the dequantized reference
(`pipeline.model.modelopt.dequantize_weight`, `pipeline.model.fake_quant`):

* FP8 (ModelOpt per-tensor weight and static input scales): `TensorWise` for one linear; the grouped
  kernel takes `RowWise` scales, so a per-expert weight scale becomes one row of an [E, N] scale tensor
  and the input scale one value per activation row.
* NVFP4: packed E2M1 codes are already what `torch.float4_e2m1fn_x2` stores (low nibble = even column,
  as torch's own tests pack them), so packing is a reinterpretation; the E4M3 block scales (one per 16
  values) go to the 128x4 tile layout cuBLAS documents for block-scaled GEMMs
  (https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout, `SwizzleType.SWIZZLE_32_4_4`),
  the same arrangement as torch's `to_blocked` test helper. In a grouped GEMM each group's scales are
  laid out as their own 128-row padded tile block, groups one after another.
* Expert ordering: the routed slots sorted by expert with int32 end offsets, computed on the device
  without a host sync (CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pipeline.model.fake_quant import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK, e2m1_round

TILE_ROWS, TILE_COLS = 128, 4  # one swizzled scale tile: 128 rows x 4 scale columns (64 values of K)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- FP8 ---------------------------------------------------------------------------------------------
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / scale)) with the division in fp32: the operand whose dequantization `fp8_fake_quant`
    computes. Three passes over the activations, not four: dividing a bf16 tensor by a 1-element fp32
    tensor (not a 0-dim one, which would not take part in type promotion) gives float(x) / scale in fp32
    directly, without first writing x as fp32 (at 16 canvases the 26B's eager FP8 pass spends a quarter of
    its time on such element-wise passes: BENCHMARKS.md, "26B-A4B denoise pass")."""
    s = scale.float()
    q = torch.div(x, s.reshape(1) if s.dim() == 0 else s)
    return q.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


class QuantizedRows(NamedTuple):
    """Activation rows already quantized for their GEMM by the kernel that made them (the GPU path's FFN
    inputs), without the rows ever written in their own dtype: the operand and the scales the GEMM's own
    quantization would give (`ScaledLinear.quantize`'s scale list for a linear, `quantize_rows`' per-row or
    per-block scales for the experts)."""

    operand: torch.Tensor  # E4M3 codes [..., K], or E2M1 codes in pairs [..., K / 2]
    scales: tuple[torch.Tensor, ...]
    dtype: torch.dtype  # the rows' dtype: what the GEMM's consumers compute in


def fp8_rowwise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] re-quantized to E4M3 with one scale per output row ([..., N] fp32):
    the FP8 form of a weight whose own format has no kernel on this GPU (NVFP4 on Hopper)."""
    amax = w.float().abs().amax(-1).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return fp8_quantize(w, scale[..., None]), scale


def fp8_expert_row_scales(weight_scales: torch.Tensor, n: int) -> torch.Tensor:
    """Per-expert tensor-wise weight scales [E] (or [E, 1]: each stored as a 1-element tensor rather than a
    0-dim one) -> the grouped kernel's RowWise scales [E, N]. Scales of another shape (one per output row)
    are refused: spread as one per expert they would give each expert rows of another's scales."""
    if weight_scales.dim() == 2 and weight_scales.shape[1] == 1:
        weight_scales = weight_scales[:, 0]
    if weight_scales.dim() != 1:
        raise ValueError(f"FP8 expert weight scales {tuple(weight_scales.shape)}: one per expert expected")
    return weight_scales.float().reshape(-1, 1).expand(-1, n).contiguous()


# ---- NVFP4 -------------------------------------------------------------------------------------------
def as_fp4x2(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's uint8 [.., K/2] (two E2M1 codes per byte, low nibble = even column) as torch's
    float4_e2m1fn_x2, which packs the same way: a view, no copy."""
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (sign in bit 3) of values already on the E2M1 grid."""
    mag = x.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i, v in enumerate((0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), start=1):
        code = torch.where(mag == v, torch.full_like(code, i), code)
    return code | ((x < 0) & (mag > 0)).to(torch.uint8) << 3


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] uint8, low nibble = even column (ModelOpt's and torch's order)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic NVFP4 activation quantization, exactly the rounding `nvfp4_fake_quant` emulates:
    returns (packed uint8 [..., K/2], E4M3 block scales [..., K/16]) with
    dequant = e2m1 * block_scale * global_scale. (A block whose scale rounds below 1e-5 is all zero
    here; the emulation divides it by 1 instead, which differs only for blocks ~1e-6 of the tensor's
    amax that still hold values >= 0.25.)"""
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = global_scale.float().clamp(min=1e-12)
    bs = (xf.abs().amax(-1, keepdim=True) / (E2M1_MAX * gs)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    s = bs.float() * gs
    safe = torch.where(s >= 1e-5, s, torch.ones_like(s))
    q = e2m1_round(xf.abs() / safe) * (s >= 1e-5)
    codes = e2m1_codes(torch.where(xf >= 0, q, -q)).reshape(shape)
    return pack_e2m1(codes), bs.reshape(*shape[:-1], shape[-1] // NVFP4_BLOCK)


def blocked_shape(rows: int, cols: int) -> tuple[int, int]:
    """The [rows, cols] of block scales padded to whole 128x4 tiles: what `to_blocked` lays out."""
    return ceil_div(rows, TILE_ROWS) * TILE_ROWS, ceil_div(cols, TILE_COLS) * TILE_COLS


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] block scales -> the flat 128x4-tile layout (rows padded to 128, cols to 4 with
    zeros; inside a tile, row r and column c land at (r % 32) * 16 + (r // 32) * 4 + c)."""
    rows, cols = scales.shape
    padded = scales.new_zeros(blocked_shape(rows, cols))
    padded[:rows, :cols] = scales
    tiles = padded.view(-1, TILE_ROWS, padded.shape[1] // TILE_COLS, TILE_COLS).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, TILE_COLS).transpose(1, 2).reshape(-1)


def from_blocked(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocked` (drops the padding)."""
    rb, cb = ceil_div(rows, TILE_ROWS), ceil_div(cols, TILE_COLS)
    tiles = flat.reshape(-1, 32, 4, TILE_COLS).transpose(1, 2).reshape(rb, cb, TILE_ROWS, TILE_COLS)
    return tiles.permute(0, 2, 1, 3).reshape(rb * TILE_ROWS, cb * TILE_COLS)[:rows, :cols]


def blocked_rows_bound(m: int, groups: int) -> int:
    """Rows of a grouped activation scale tensor for any split of `m` rows into `groups` groups: each
    group padded to 128 rows, so at most round_up(m, 128) + 128 * groups. Static, so a CUDA graph can
    hold it."""
    return (ceil_div(m, TILE_ROWS) + groups) * TILE_ROWS


def to_blocked_grouped(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Scales [M, C] of rows grouped by `offs` (int32 end offsets) -> each group's `to_blocked` layout,
    groups back to back at 128-row-aligned starts, in a [blocked_rows_bound(M, G), round_up(C, 4)]
    tensor (zeros past the last group). Device-side index arithmetic only: no host sync."""
    m, c = scales.shape
    g = offs.shape[0]
    cp = blocked_shape(m, c)[1]
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (ends - starts + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    pstart = torch.cumsum(padded, 0) - padded  # each group's first row in the blocked tensor
    row = torch.arange(m, device=scales.device)
    grp = torch.bucketize(row, ends, right=True).clamp(max=g - 1)
    r = row - starts[grp]  # row inside its group
    tile_row = pstart[grp] + r // TILE_ROWS * TILE_ROWS  # first row of its 128-row tile block
    col = torch.arange(c, device=scales.device)
    # flat index inside one group block of width cp: tiles ordered (row tile, col tile), 512 each
    within = (r % 32 * 16 + (r % TILE_ROWS) // 32 * 4)[:, None] + (col % TILE_COLS)[None, :]
    flat = (tile_row * cp)[:, None] + (col // TILE_COLS * 512)[None, :] + within
    out = scales.new_zeros(blocked_rows_bound(m, g) * cp)
    out[flat.reshape(-1)] = scales.reshape(-1)
    return out.view(-1, cp)


def nvfp4_weight_blocked(block_scales: torch.Tensor) -> torch.Tensor:
    """Stacked expert (or single) weight block scales [..., N, K/16] -> swizzled, one block per matrix:
    [E, blocked] for a 3-D input, flat for a 2-D one."""
    if block_scales.dim() == 2:
        return to_blocked(block_scales)
    # `to_blocked` of each matrix, in one set of ops for all of them (a load's 128 experts: 6 ops, not 768)
    e, rows, cols = block_scales.shape
    padded = block_scales.new_zeros(e, *blocked_shape(rows, cols))
    padded[:, :rows, :cols] = block_scales
    tiles = padded.view(e, -1, TILE_ROWS, padded.shape[2] // TILE_COLS, TILE_COLS).permute(0, 1, 3, 2, 4)
    return tiles.reshape(e, -1, 4, 32, TILE_COLS).transpose(2, 3).reshape(e, -1)


# ---- expert ordering ----------------------------------------------------------------------------------
class ExpertOrder(NamedTuple):
    """The routed slots (token-major, `index.reshape(-1)`) sorted by expert, stably."""

    order: torch.Tensor  # the slot at each sorted position
    token_of: torch.Tensor  # the token of each sorted slot
    offs: torch.Tensor  # int32 end offset of each expert's slots
    rows: torch.Tensor | None = (
        None  # each slot's sorted position (`order`'s inverse), where a kernel wrote it
    )


# a fused form of `expert_order`: (index, num_experts) -> the slots' order, with `rows`
OrderKernel = Callable[[torch.Tensor, int], ExpertOrder]


def expert_order(index: torch.Tensor, num_experts: int, kernel: OrderKernel | None = None) -> ExpertOrder:
    """Routed slots sorted by expert (`ExpertOrder`; `rows` None here: `slot_rows` makes it where needed).
    No host sync: a CUDA graph can capture it (`pipeline.model.network.grouped_experts`
    and the tensor-core experts both route with it). Expert e's slots end where the sorted experts pass e:
    one search of the sorted experts for every expert, three launches fewer than counting them and adding
    the counts up (zeros, a scatter-add, its ones, a cumulative sum). `kernel`: a fused form
    (`pipeline.runtime.kernels.routing.expert_order`), not traced (under torch.compile the torch form)."""
    if kernel is not None and not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
        return kernel(index, num_experts)
    flat = index.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    ids = torch.arange(num_experts, device=index.device, dtype=flat.dtype)
    offs = torch.searchsorted(experts, ids, right=True, out_int32=True)
    return ExpertOrder(order, order // index.shape[1], offs)


def slot_rows(routing: ExpertOrder) -> torch.Tensor:
    """Each slot's position in the sorted order: `routing.rows` where the order kernel wrote them, else
    `order`'s inverse (two launches: `y.index_select(0, rows)` puts rows sorted by `order` back in slot
    order, a gather where `index_copy_(0, order, y)` would scatter)."""
    if routing.rows is not None:
        return routing.rows
    order = routing.order
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv
