"""The Triton kernels of `pipeline.runtime.kernels.quant` (imported on first use; see there)."""

import triton
import triton.language as tl


@triton.jit
def fp8_static_quant(x_ptr, scale_ptr, out_ptr, n, E4M3_MAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
    v = tl.math.div_rn(x, tl.load(scale_ptr).to(tl.float32))
    v = tl.clamp(v, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + i, e4m3(v), mask=inside)


@triton.jit
def e4m3(v):
    """fp32 values v (within E4M3's +-448, or NaN) as E4M3 codes, rounded once to nearest, ties to even:
    torch's conversion. Every kernel converts through here.

    v is first rounded to E4M3's grid in fp32 (`e4m3_grid`), so the conversion after it is exact however
    the compiler lowers it. Triton before 3.9 lowers fp32 -> E4M3 on sm_89 (Ada) through fp16 rounded toward
    zero (`cvt.rz.f16.f32`, then `cvt.rn.satfinite.e4m3x2.f16x2`): two roundings, which put about 0.4% of
    the codes of normally distributed values one step off torch's, and the load-time probes would then send
    every FP8 kernel to its torch form. torch 2.11 and 2.12 bring Triton 3.6 and 3.7."""
    return e4m3_grid(v).to(tl.float8e4nv)


@triton.jit
def negated(x):
    """-x for fp32 values x: their sign bit flipped, as torch's negation does (-0.0 for +0.0, NaN's sign
    too). Every kernel negates through here: Triton before 3.8 (torch 2.11 and 2.12 bring 3.6 and 3.7)
    computes its unary minus on floats as 0 - x, which gives +0.0, and the kernels are held to torch's values
    bit for bit, the sign of zero included (x * -1.0 would keep a NaN's sign where the CPU computes it)."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_grid(v):
    """fp32 values v rounded to the nearest E4M3 value, ties to even, still in fp32 (NaN stays NaN, -0.0
    stays -0.0; values past +-448 are the callers' to clamp). E4M3's spacing at |v| is 2^(e-3) for |v| in
    [2^e, 2^(e+1)), e >= -6, and 2^-9 below (subnormals), which is fp32's spacing at 2^(e+20): adding that
    power of two rounds |v| to it (an IEEE addition: nearest, ties to even), and subtracting it is exact."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = tl.minimum(tl.maximum(mag >> 23, 127 - 6), 127 + 8)  # |v|'s biased exponent, within E4M3's span
    big = ((e + 20) << 23).to(tl.float32, bitcast=True)  # 2^(e + 20)
    rounded = ((mag.to(tl.float32, bitcast=True) + big) - big).to(tl.int32, bitcast=True)
    return (rounded | (bits - mag)).to(tl.float32, bitcast=True)  # bits - mag: v's sign bit


@triton.jit
def e2m1_code(a):
    """How many of E2M1's decision points a >= 0 passes: the index of its nearest magnitude in
    (0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even mantissa (0.75, 1.75 and 3.5 round up)."""
    return (
        (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    )  # fmt: skip


@triton.jit
def block_scale(amax, gs, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr):
    """The E4M3 scale of a 16-value block whose largest magnitude is `amax` (NaN if it holds a NaN)."""
    s = tl.minimum(tl.math.div_rn(amax, E2M1_MAX * gs), E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return e4m3(s)


@triton.jit
def nvfp4_codes(x_ptr, gs_ptr, packed_ptr, b, inside, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr):
    """Blocks b (16 values each, where `inside`) of x: their E2M1 codes stored in pairs, their E4M3 scales
    returned."""
    pair = b[:, None] * 16 + 2 * tl.arange(0, 8)[None, :]  # even columns; odd ones at +1
    even = tl.load(x_ptr + pair, mask=inside[:, None], other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + pair + 1, mask=inside[:, None], other=0.0).to(tl.float32)
    codes, bs = nvfp4_encode(even, odd, gs_ptr, E2M1_MAX, E4M3_MAX)
    tl.store(packed_ptr + pair // 2, codes, mask=inside[:, None])
    return bs


@triton.jit
def nvfp4_encode(even, odd, gs_ptr, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr):
    """Blocks of 16 fp32 values, their even and odd columns [blocks, 8] each: (their E2M1 codes in pairs,
    uint8 [blocks, 8], low nibble the even column; their E4M3 scales [blocks]) under the global scale."""
    gs = tl.maximum(tl.load(gs_ptr).to(tl.float32), 1e-12, propagate_nan=tl.PropagateNan.ALL)
    amax = tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1))
    nan = tl.max(((even != even) | (odd != odd)).to(tl.int32), 1) > 0
    bs = block_scale(tl.where(nan, float("nan"), amax), gs, E2M1_MAX, E4M3_MAX)
    s = bs.to(tl.float32) * gs
    valid = s >= 1e-5  # a block whose scale rounds below that is all zero codes
    safe = tl.where(valid, s, 1.0)[:, None]
    lo = tl.where(valid[:, None], e2m1_code(tl.math.div_rn(tl.abs(even), safe)), 0)
    hi = tl.where(valid[:, None], e2m1_code(tl.math.div_rn(tl.abs(odd), safe)), 0)
    lo = tl.where((even < 0) & (lo > 0), lo | 8, lo)  # the sign bit, on non-zero codes
    hi = tl.where((odd < 0) & (hi > 0), hi | 8, hi)
    return (lo | (hi << 4)).to(tl.uint8), bs


@triton.jit
def nvfp4_quant(
    x_ptr, gs_ptr, packed_ptr, scales_ptr, blocks, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr,
    BLOCKS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    inside = b < blocks
    bs = nvfp4_codes(x_ptr, gs_ptr, packed_ptr, b, inside, E2M1_MAX, E4M3_MAX)
    tl.store(scales_ptr + b, bs, mask=inside)


@triton.jit(do_not_specialize=["rows"])  # token counts: one binary for every length
def nvfp4_quant_blocked(
    x_ptr, gs_ptr, packed_ptr, out_ptr, rows, C, CP, padded, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr,
    BLOCKS: tl.constexpr,
):  # fmt: skip
    """`nvfp4_quant` of x [rows, 16 * C] with its scales written in the 128x4-tile layout of [rows padded to
    128, C padded to CP] (`blocked_index`): programs run over the padded blocks and write the padding's
    zeros too."""
    p = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    r = p // CP
    c = p - r * CP
    real = (r < rows) & (c < C)
    bs = nvfp4_codes(x_ptr, gs_ptr, packed_ptr, r * C + c, real, E2M1_MAX, E4M3_MAX)
    bits = tl.where(real, bs.to(tl.uint8, bitcast=True), 0)
    tl.store(out_ptr + blocked_index(r, c, CP), bits, mask=p < padded)


@triton.jit
def blocked_index(r, c, CP):
    """Where scale (r, c) of a [R, CP] matrix (R a multiple of 128, CP of 4) lands in the flat 128x4-tile
    layout (`scaled_layout.to_blocked`): tiles row block after row block, 512 bytes each; inside one, row r
    and column c at (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4."""
    return r // 128 * 128 * CP + r % 32 * 16 + r % 128 // 32 * 4 + c // 4 * 512 + c % 4


@triton.jit
def nvfp4_fp8_rows(
    x_ptr, gs_ptr, out_ptr, scales_ptr, K, stride_x, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr,
    NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NB)[:, None] * 16 + tl.arange(0, 16)[None, :]
    inside = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0)
    v = nvfp4_rounded(x.to(tl.float32), gs_ptr, E2M1_MAX, E4M3_MAX).to(x.dtype).to(tl.float32)  # x's dtype
    q8, row_scale = fp8_of_row(v, E4M3_MAX)
    tl.store(out_ptr + row * K + offs, q8, mask=inside)
    tl.store(scales_ptr + row, row_scale)


@triton.jit
def nvfp4_rounded(xf, gs_ptr, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr):
    """Blocks of 16 fp32 values [NB, 16] rounded to NVFP4 under the global scale, in fp32: what
    `fake_quant.nvfp4_fake_quant` computes before its rounding to the input's dtype."""
    g = tl.load(gs_ptr).to(tl.float32)
    gs = tl.where(g > 0, g, 1e-12)
    amax = tl.max(tl.abs(xf), 1)
    nan = tl.max((xf != xf).to(tl.int32), 1) > 0
    s = block_scale(tl.where(nan, float("nan"), amax), gs, E2M1_MAX, E4M3_MAX).to(tl.float32) * gs
    s = tl.where(s >= 1e-5, s, 1.0)[:, None]
    code = e2m1_code(tl.math.div_rn(tl.abs(xf), s))
    mag = tl.where(
        code < 4, code * 0.5, tl.where(code < 6, code - 2.0, code * 2.0 - 8.0)
    )  # 0 .5 1 1.5 | 2 3 | 4 6
    q = mag * s
    return tl.where(xf >= 0, q, negated(q))


@triton.jit
def fp8_of_row(v, E4M3_MAX: tl.constexpr):
    """One row's fp32 values v [NB, 16] (zeros past the row) as E4M3 codes at the row's own scale
    max|v| / 448, and that scale: what `tensor_cores._rowwise_dynamic` computes."""
    row_scale = tl.maximum(tl.math.div_rn(tl.max(tl.max(tl.abs(v), 1), 0), E4M3_MAX), 1e-12)
    q8 = tl.clamp(tl.math.div_rn(v, row_scale), -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return e4m3(q8), row_scale


@triton.jit
def blocked_scales(
    scales_ptr, offs_ptr, rows_ptr, out_ptr, R, C, CP, num_groups, GATHER: tl.constexpr, G_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Block scales [rows, C] of rows grouped by the int32 end offsets `offs` in the layout of
    `scaled_layout.to_blocked_grouped`: each group's rows from a 128-row boundary of R output rows, each
    group padded to whole 128-row tiles. As every group starts on a tile boundary, that layout is
    `blocked_index` of the [R, CP] matrix whose row o holds its group's row o - (the group's first
    output row), or zeros: programs run over those output rows and write every byte, padding included.
    `GATHER`: grouped row i is row rows[i] of the scales (the rows' gather to expert order, done here)."""
    o = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # output rows (int32: the caller checks)
    e = tl.arange(0, G_POW2)
    live = e < num_groups
    ends = tl.load(offs_ptr + e, mask=live, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=live & (e > 0), other=0)
    padded = tl.where(live, (ends - starts + 127) // 128 * 128, 0)  # each group's rows, padded to 128
    before = (tl.cumsum(padded, 0)[None, :] <= o[:, None]) & live[None, :]  # groups wholly before row o
    g = tl.sum(before.to(tl.int32), 1)
    pstart = tl.sum(tl.where(before, padded[None, :], 0), 1)  # first output row of o's group
    mine = e[None, :] == g[:, None]
    start = tl.sum(tl.where(mine, starts[None, :], 0), 1)
    size = tl.sum(tl.where(mine, (ends - starts)[None, :], 0), 1)  # 0 past the last group
    src = start + o - pstart
    live_row = (o - pstart < size) & (o < R)
    if GATHER:
        src = tl.load(rows_ptr + src, mask=live_row, other=0).to(tl.int32)
    c = tl.arange(0, BLOCK_C)
    real = live_row[:, None] & (c < C)[None, :]
    value = tl.load(scales_ptr + src[:, None] * C + c[None, :], mask=real, other=0)
    flat = blocked_index(o[:, None], c[None, :], CP)
    tl.store(out_ptr + flat, value, mask=(o < R)[:, None] & (c < CP)[None, :])
