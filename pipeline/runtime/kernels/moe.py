"""dgpipe's Triton MoE GEMM for the routed experts: FP8 on Hopper for passes with few rows per expert; FP8 and
bf16 on Ada and RTX Blackwell for every pass (`pipeline.runtime.routed` for bf16). The activations' FP8 and
NVFP4 quantization kernels are `pipeline.runtime.kernels.quant`.

The MoE GEMM. At one canvas a pass routes 2,048 slots over 128 experts, ~16 rows per expert. torch's
`F.scaled_grouped_mm` (CUTLASS, aten/src/ATen/native/cuda/ScaledGroupMM.cu) runs that on a 64x128 tile in
2x2 thread-block clusters, and a group with a single 64-row tile still takes a whole cluster pair along M:
on an H200 it streamed the experts' FP8 weights at 2.1 TB/s (44% of HBM), about what half of the 132 SMs
can pull. The field's answer is a Triton MoE GEMM with a small M tile (vLLM's `fused_moe` kernel); vLLM
does not install on an air-gapped GPU host, while Triton ships with every CUDA build of torch. Here every
program computes one (expert, M block, N block) tile, so every SM streams weights, the slots' token
rows are gathered inside the kernel instead of being copied to expert order first, and the down
projection's rows can be written straight back to token-major slot order (`out_rows`), the layout the
combine reads, instead of gathered there after. On Ada and RTX Blackwell
(sm89, sm120) torch has no FP8 grouped GEMM and its bf16 one falls back to a per-expert loop that syncs with
the host, so there this kernel takes every pass (`pipeline.runtime.dispatch.EVERY_PASS`), FP8 or bf16; torch has
no fp16 grouped GEMM kernel on any GPU, so a model loaded in fp16 takes it on every GPU of the dispatch
table. Layout (as
`pipeline.runtime.tensor_cores.grouped_gemm`): slots sorted by expert with int32 end offsets `offs` [E]
(`scaled_layout.expert_order`); each program finds its expert from those offsets on the device (no host
sync: CUDA graphs capture it). Operands: `a` E4M3 [rows, K] with one fp32 scale per row, `w` E4M3
[E, N, K] with one fp32 scale per output row [E, N]; the result is bf16 [slots, N], each slot's row
acc * a_scale * w_scale, as torch's RowWise kernels compute. Or `a` and `w` bf16 (or fp16) without scales,
the result in their dtype, as `F.grouped_mm` computes. Its tile sizes, warps, stages and launch order (`tiles`) come from this GPU
model's measured table where one exists (`pipeline.runtime.kernels.moe_tiles`, written by `dgpipe bench
moe-tiles`), else from `default_tile`.

It is checked in Triton's interpreter on the CPU and compiled for sm_90a, sm_89 and sm_120 there
(tests/unit/runtime/kernels/test_moe.py), and on the GPU by tests/gpu and the load-time probe.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from pipeline.runtime.dispatch import TRITON_MAX_ROWS_PER_EXPERT
from pipeline.runtime.kernels import moe_tiles
from pipeline.runtime.kernels.moe_tiles import Tile, TileTable


def unavailable(device: torch.device) -> str | None:
    """Why these kernels cannot run on `device`, or None. Triton's interpreter (TRITON_INTERPRET=1) runs
    them on the CPU for tests."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it comes with torch's CUDA builds)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton kernels run on CUDA devices, not {device.type} (TRITON_INTERPRET=1 for the CPU)"
    return None


def serves(slots: int, experts: int, max_rows: float = TRITON_MAX_ROWS_PER_EXPERT) -> bool:
    """Whether a grouped GEMM of `slots` rows over `experts` experts takes this kernel (a shape decision,
    fixed per pass: graph- and compile-safe), given the dispatch row's `triton_rows`; above Hopper's
    threshold torch's grouped GEMM, whose tiles fill at 256 rows per expert, keeps the experts.
    `dgpipe bench gpu` times both."""
    return max_rows > 0 and slots <= max_rows * experts


FLOAT_OPERANDS = (torch.bfloat16, torch.float16)  # the unscaled operand dtypes `tl.dot` takes on tensor cores
BLOCK_MS = (16, 32, 64)  # the M tiles `default_tile` picks from (the load-time probe runs each)
GRID_Y_MAX = 65535  # CUDA's limit on a grid's second axis


def default_tile(slots: int, experts: int, element_bytes: int = 1) -> Tile:
    """The tile for `slots` rows over `experts` where no measured table names one (`moe_tiles`): an M tile
    that covers an expert's expected rows in one block, so its weights are read once (small M tiles for few
    rows per expert, as vLLM's fused-MoE kernel takes them), 128 bytes along K (FP8: four of Hopper's
    32-deep MMA steps; bf16: 64 values, the same shared memory). More rows per expert (every pass on
    sm89/sm120: 256 at 16 canvases) take 64-row tiles; an expert's M blocks are neighbours in the launch
    order, so after the first its weight tiles come from L2. Four stages of the 64-row tile take 72 KB of
    shared memory, within the 99 KB a block gets on sm89 and sm120 (test)."""
    avg = slots / max(experts, 1)
    block_m = BLOCK_MS[0] if avg <= 8 else BLOCK_MS[1] if avg <= 24 else BLOCK_MS[2]
    return Tile(block_m=block_m, block_n=128, block_k=128 // element_bytes, num_warps=4, num_stages=4)


def tiles(
    slots: int, experts: int, n: int, k: int, element_bytes: int = 1, table: TileTable | None = None
) -> Tile:
    """The tile a GEMM of `slots` rows over `experts` experts' [n, k] weights launches with: the measured
    table's (`moe_tiles`: this GPU model, this shape, the nearest rows per expert), else `default_tile`. A
    host-side choice from shapes alone: graph- and compile-safe."""
    tuned = table.pick(n, k, slots / max(experts, 1)) if table is not None else None
    return tuned or default_tile(slots, experts, element_bytes)


def tile_for(slots: int, w: torch.Tensor, element_bytes: int) -> Tile:
    """The tile `moe_gemm` launches a GEMM of `slots` rows over the weights `w` [E, N, K] with, operands of
    `element_bytes`, on w's GPU: `tiles` with this GPU model's measured table."""
    experts, n, k = w.shape
    table = moe_tiles.table_for(w.device, moe_tiles.operand_of(element_bytes))
    return tiles(slots, experts, n, k, element_bytes, table)


def default_tiles(element_bytes: int) -> list[Tile]:
    """Every tile `default_tile` can pick, one per M tile in `BLOCK_MS`."""
    return [default_tile(1, 1, element_bytes).model_copy(update={"block_m": m}) for m in BLOCK_MS]


def probe_tiles(device: torch.device, element_bytes: int) -> list[Tile]:
    """Every tile a pass on `device` may launch with: `default_tile`'s and this GPU's measured table's. The
    load-time probe runs each against the float reference."""
    table = moe_tiles.table_for(device, moe_tiles.operand_of(element_bytes))
    return list(dict.fromkeys(default_tiles(element_bytes) + (table.all_tiles() if table else [])))


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (Triton reads TRITON_INTERPRET when `jit` wraps it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm(
        a_ptr, a_scale_ptr, rows_ptr, w_ptr, w_scale_ptr, offs_ptr, out_ptr, out_rows_ptr,
        N, K, num_experts, stride_am, stride_as, stride_we, stride_wn, stride_om,
        GATHER: tl.constexpr, SCATTER: tl.constexpr, SCALED: tl.constexpr, DOT_F32: tl.constexpr,
        E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        N_FASTEST: tl.constexpr,
    ):  # fmt: skip
        # the launch order (`Tile.n_fastest`): CUDA starts blocks along grid axis 0 first
        if N_FASTEST:
            pid_m, pid_n = tl.program_id(1), tl.program_id(0)
        else:
            pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        # which expert and which of its M blocks this program is: from the end offsets, on the device
        e = tl.arange(0, E_POW2)
        live = e < num_experts
        ends = tl.load(offs_ptr + e, mask=live, other=0)
        starts = tl.load(offs_ptr + e - 1, mask=live & (e > 0), other=0)
        blocks = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        cum = tl.cumsum(blocks, 0)
        if pid_m >= tl.sum(blocks, 0):
            return
        expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
        mine = e == expert
        first_block = tl.sum(tl.where(mine, cum - blocks, 0), 0)
        row0 = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first_block) * BLOCK_M
        end = tl.sum(tl.where(mine, ends, 0), 0)
        slot = row0 + tl.arange(0, BLOCK_M)
        in_m = slot < end
        if GATHER:
            row = tl.load(rows_ptr + slot, mask=in_m, other=0)
        else:
            row = slot
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            in_k = k < K
            a = tl.load(a_ptr + row.to(tl.int64)[:, None] * stride_am + k[None, :],
                        mask=in_m[:, None] & in_k[None, :], other=0.0)  # fmt: skip
            b = tl.load(
                w_base + n[None, :] * stride_wn + k[:, None], mask=in_k[:, None] & in_n[None, :], other=0.0
            )
            if DOT_F32:  # Triton's CPU interpreter only: it multiplies bf16 operands as integers
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if SCALED:
            a_scale = tl.load(a_scale_ptr + row * stride_as, mask=in_m, other=0.0)
            w_scale = tl.load(w_scale_ptr + expert * N + n, mask=in_n, other=0.0)
            acc = acc * a_scale[:, None] * w_scale[None, :]
        out = acc.to(out_ptr.dtype.element_ty)  # bf16 for FP8 operands; else the operands' dtype
        if SCATTER:  # each row to where `out_rows` puts it (the slots' token-major order)
            dest = tl.load(out_rows_ptr + slot, mask=in_m, other=0)
        else:
            dest = slot
        tl.store(
            out_ptr + dest.to(tl.int64)[:, None] * stride_om + n[None, :],
            out,
            mask=in_m[:, None] & in_n[None, :],
        )

    return moe_gemm


def moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    rows: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    offs: torch.Tensor,
    block_m: int | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """[slots, N]: slot i is a[rows[i]] (a[i] without `rows`) times its expert's w [E, N, K] (K
    contiguous). FP8 operands are scaled by a_scale [rows of a] (fp32, any stride) and w_scale [E, N]
    (fp32), the result bf16; bf16 or fp16 operands take no scales (None), the result in their dtype. The
    experts own consecutive slots, ending at `offs` [E] (int32, device). Launched with `tiles`' tile for
    the shape on this GPU; `block_m`: another M tile (the benchmark's comparison). `out_rows`: a
    permutation of the slots; slot i's row is written to row out_rows[i] (the expert order's `order` puts
    the rows back in token-major slot order, as `network.combine_top_k`'s gather would)."""
    slots = rows.shape[0] if rows is not None else a.shape[0]
    tile = tile_for(slots, w, a.element_size())
    if block_m:
        tile = tile.model_copy(update={"block_m": block_m})
    return launch(tile, a, a_scale, rows, w, w_scale, offs, out_rows)


def launch(
    tile: Tile,
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    rows: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    offs: torch.Tensor,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`moe_gemm` with the given tile (the probe and `dgpipe bench moe-tiles` run every candidate)."""
    import triton

    scaled = a_scale is not None
    if scaled != (w_scale is not None) or scaled != (a.element_size() == 1):
        raise ValueError("FP8 operands take both scales, bf16 and fp16 operands neither")
    if not scaled and (a.dtype != w.dtype or a.dtype not in FLOAT_OPERANDS):
        raise ValueError(f"float operands are bf16 or fp16, both one dtype (got {a.dtype} and {w.dtype})")
    if w.stride(-1) != 1:
        raise ValueError("the MoE GEMM reads K-contiguous weights (w [E, N, K])")
    a = a if a.stride(-1) == 1 else a.contiguous()  # rows at any stride, K contiguous
    slots = rows.shape[0] if rows is not None else a.shape[0]
    experts, n, k = w.shape
    out = torch.empty(slots, n, dtype=out_dtype(a), device=a.device)
    if slots == 0:
        return out
    bm, bn = tile.block_m, tile.block_n
    # every expert's last M block may be partial: at most one block more each
    m_blocks, n_blocks = triton.cdiv(slots, bm) + experts, triton.cdiv(n, bn)
    n_fastest = tile.n_fastest and m_blocks <= GRID_Y_MAX  # else M first: the same product, in another order
    grid = (n_blocks, m_blocks) if n_fastest else (m_blocks, n_blocks)
    w_scale = w_scale.contiguous() if scaled else offs  # unread placeholders when not `scaled`
    _kernel()[grid](
        a, a_scale if scaled else offs, rows if rows is not None else offs, w, w_scale, offs, out,
        out_rows if out_rows is not None else offs,
        n, k, experts, a.stride(0), a_scale.stride(0) if scaled else 0, w.stride(0), w.stride(1), out.stride(0),
        GATHER=rows is not None, SCATTER=out_rows is not None, SCALED=scaled, DOT_F32=not scaled and _interpreted(),
        E_POW2=triton.next_power_of_2(experts), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=tile.block_k, N_FASTEST=n_fastest,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out


# Under torch.compile the kernel is one opaque custom op (its fake kernel gives the output's shape and dtype),
# registered at import: registering inside a compiled region is itself a graph break.
moe_gemm_op = torch.library.custom_op("dgpipe::moe_gemm", mutates_args=())(moe_gemm)
moe_gemm_op.register_fake(
    lambda a, a_scale, rows, w, w_scale, offs, block_m=None, out_rows=None: a.new_empty(
        (a.shape[0] if rows is None else rows.shape[0], w.shape[1]), dtype=out_dtype(a)
    )
)


def out_dtype(a: torch.Tensor) -> torch.dtype:
    """The GEMM's result dtype: bf16 for FP8 operands (as torch's RowWise kernels write), else a's."""
    return torch.bfloat16 if a.element_size() == 1 else a.dtype


def _interpreted() -> bool:
    """Triton's CPU interpreter runs the kernels (tests; `unavailable`). Its `tl.dot` of bf16 operands
    multiplies their bit patterns as integers (Triton 3.9: ~1e10 for unit-size values), so there the bf16
    operands are widened to fp32 first; FP8 operands it multiplies correctly."""
    return os.environ.get("TRITON_INTERPRET") == "1"
