"""The Triton kernels of `pipeline.runtime.kernels.chains` (imported on first use; see there)."""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from pipeline.runtime.kernels.jit.quant import (
    blocked_index,
    e4m3,
    fp8_of_row,
    negated,
    nvfp4_encode,
    nvfp4_rounded,
)


@triton.jit(do_not_specialize=["rows"])  # token counts: one binary for every length
def rope(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rows,
    heads,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """x [tokens * heads, 2 * HALF] rotated by its token's cos/sin [tokens, 2 * HALF], each product and the
    sum rounded to x's dtype as torch's element-wise kernels round them."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, HALF_P2)[None, :]
    inside = (r < rows)[:, None] & (j < HALF)
    row = r[:, None] * (2 * HALF) + j
    lo = tl.load(x_ptr + row, mask=inside, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + row + HALF, mask=inside, other=0.0).to(tl.float32)
    out_lo, out_hi = _rotate(lo, hi, cos_ptr, sin_ptr, (r // heads)[:, None] * (2 * HALF) + j, inside, HALF)
    tl.store(out_ptr + row, out_lo, mask=inside)
    tl.store(out_ptr + row + HALF, out_hi, mask=inside)


@triton.jit
def _rotate(lo, hi, cos_ptr, sin_ptr, tok, inside, HALF: tl.constexpr):
    """Rows' halves lo, hi (fp32 holding values of cos's dtype) rotated by their token's cos/sin at `tok`:
    (lo * cos - hi * sin, hi * cos + lo * sin) in cos's dtype, torch's `x * cos + rotate_half(x) * sin`
    (rotate_half(x) = [-hi, lo]). A product of two bf16/fp16 values is exact in fp32, so each rounding below
    is the one torch's kernel makes (and keeps the compiler from fusing a multiply into the add)."""
    dt = cos_ptr.dtype.element_ty
    cos_lo = tl.load(cos_ptr + tok, mask=inside, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + tok + HALF, mask=inside, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + tok, mask=inside, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + tok + HALF, mask=inside, other=0.0).to(tl.float32)
    out_lo = (lo * cos_lo).to(dt).to(tl.float32) + (negated(hi) * sin_lo).to(dt).to(tl.float32)
    out_hi = (hi * cos_hi).to(dt).to(tl.float32) + (lo * sin_hi).to(dt).to(tl.float32)
    return out_lo.to(dt), out_hi.to(dt)


@triton.jit
def softcap(x_ptr, out_ptr, n, inv_cap, cap, BLOCK: tl.constexpr):
    """fp32 tanh(x * inv_cap) * cap of bf16/fp16/fp32 logits x: torch's CUDA `x.float().div_(cap).tanh_().mul_(cap)`."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, libdevice.tanh(x * inv_cap) * cap, mask=inside)


@triton.jit
def combine(
    y_ptr, rows_ptr, w_ptr, out_ptr, D, stride_y, K: tl.constexpr, GATHER: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out[t] = sum over j < K of w[t, j] * y[rows[t * K + j]] (y[t * K + j] without GATHER), the weight in
    y's dtype, products and sum in fp32 in order j = 0, 1, ..., rounded once to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        slot = t * K + j
        if GATHER:
            row = tl.load(rows_ptr + slot).to(tl.int64)
        else:
            row = slot
        w = tl.load(w_ptr + slot).to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = acc + w * tl.load(y_ptr + row * stride_y + d, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def geglu(
    gate_ptr, up_ptr, scale_ptr, out_ptr, cols, stride_gate, stride_up, BETA: tl.constexpr, KAPPA: tl.constexpr,
    E4M3_MAX: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[r] = gelu_tanh(gate[r]) * up[r] in gate's dtype, with torch's CUDA arithmetic: the GeLU in fp32 as
    `GeluCUDAKernelImpl` writes it (nvcc contracts `x + kKappa * x_cube` into one fma), rounded, then the
    product rounded; QUANT: that value's E4M3 code at the static scale (`kernels.quant.fp8`'s arithmetic)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < cols
    dt = gate_ptr.dtype.element_ty
    x = tl.load(gate_ptr + r * stride_gate + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * stride_up + c, mask=inside, other=0.0).to(tl.float32)
    h = _gelu_times(x, u, dt, BETA, KAPPA)
    if QUANT:
        v = tl.math.div_rn(h.to(tl.float32), tl.load(scale_ptr).to(tl.float32))
        v = tl.clamp(v, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + r * cols + c, e4m3(v), mask=inside)
    else:
        tl.store(out_ptr + r * cols + c, h, mask=inside)


@triton.jit
def _gelu_times(x, u, dt, BETA: tl.constexpr, KAPPA: tl.constexpr):
    """gelu_tanh(x) rounded to dt, times u, rounded to dt (x and u fp32 values of dt)."""
    inner = BETA * tl.fma(KAPPA, x * x * x, x)
    gelu = (0.5 * x * (1.0 + libdevice.tanh(inner))).to(dt).to(tl.float32)
    return (gelu * u).to(dt)  # a product of two bf16/fp16 values is exact in fp32: one rounding, torch's


@triton.jit(do_not_specialize=["rows"])  # token counts: one binary for every length
def geglu_nvfp4(
    gate_ptr, up_ptr, gs_ptr, packed_ptr, scales_ptr, rows, cols, stride_gate, stride_up, CP, BETA: tl.constexpr,
    KAPPA: tl.constexpr, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr, BLOCKED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """`geglu`'s product of row r, as NVFP4 under the global scale: its E2M1 codes in pairs [rows, cols / 2]
    and its 16-value blocks' E4M3 scales, [rows, cols / 16] or (BLOCKED) at `blocked_index` in the layout of
    [rows padded to 128, CP] a linear's FP4 GEMM reads, with the padding's zeros (the launch covers the
    padded rows, and BLOCK / 16 >= 4 scale columns a program reach the padded ones). What
    `kernels.jit.quant.nvfp4_quant` makes of `geglu`'s output, code for code."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (c < cols) & (tl.zeros_like(c) + r < rows)  # (a row past `rows`: padding, zero scales)
    x = tl.load(gate_ptr + r * stride_gate + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * stride_up + c, mask=inside, other=0.0).to(tl.float32)
    h = _gelu_times(x, u, gate_ptr.dtype.element_ty, BETA, KAPPA).to(tl.float32)
    _nvfp4_row(h, r, rows, cols, tl.program_id(1) * BLOCK, gs_ptr, packed_ptr, scales_ptr, CP, BLOCKED, E2M1_MAX,
               E4M3_MAX, BLOCK)  # fmt: skip


@triton.jit
def add_scaled(a_ptr, b_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = (a + b) * s[0] in a's dtype, the sum rounded before the product as torch's two kernels round it."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    dt = a_ptr.dtype.element_ty
    a = tl.load(a_ptr + i, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=inside, other=0.0).to(tl.float32)
    h = (a + b).to(dt).to(tl.float32)
    tl.store(out_ptr + i, (h * tl.load(s_ptr).to(tl.float32)).to(dt), mask=inside)


@triton.jit(do_not_specialize=["past", "total"])  # token counts: one binary for every length
def kv_cat(
    pk_ptr, pv_ptr, k_ptr, v_ptr, ok_ptr, ov_ptr, heads, past, total, p_sb, p_sh, p_st, n_sb, n_sh, n_st,
    D: tl.constexpr, D_P2: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """ok[b, h] = cat(pk[b, h], k[b, h]) along the tokens, and ov likewise: both rows of a block of tokens
    copied from wherever the cached (strides p_*) and new (strides n_*) K/V lie into [B, H, total, D]."""
    bh = tl.program_id(0).to(tl.int64)  # an output head
    b, h = bh // heads, bh % heads
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    inside = (t < total) & (d < D)
    cached = inside & (t < past)
    fresh = inside & (t >= past)
    at_past = b * p_sb + h * p_sh + t * p_st + d
    at_new = b * n_sb + h * n_sh + (t - past) * n_st + d
    out = (bh * total + t) * D + d
    k = tl.where(cached, tl.load(pk_ptr + at_past, mask=cached), tl.load(k_ptr + at_new, mask=fresh))
    tl.store(ok_ptr + out, k, mask=inside)
    v = tl.where(cached, tl.load(pv_ptr + at_past, mask=cached), tl.load(v_ptr + at_new, mask=fresh))
    tl.store(ov_ptr + out, v, mask=inside)


@triton.jit
def scale_columns(x_ptr, w_ptr, out_ptr, n, cols, c, BLOCK: tl.constexpr):
    """out = x * w * c for x [rows, cols], w [cols] and an fp32 number c, in x's dtype: the first product
    rounded to it (exact in fp32 for two bf16/fp16 values), the second in fp32 then rounded, as torch's two
    kernels compute them."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + i, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i % cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, ((x * w).to(dt).to(tl.float32) * c).to(dt), mask=inside)


@triton.jit
def _rstd(x, cols, eps):
    """rsqrt(mean(x^2) + eps) in fp32 for one row x (zeros past `cols`): torch's fused RMSNorm's arithmetic,
    but for the order its sum of squares is added in."""
    return tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, 0), cols.to(tl.float32)) + eps)


@triton.jit
def _rms_norm(x, w_ptr, c, inside, cols, eps):
    """x * rstd * w in fp32 (`_rstd`), as torch's fused RMSNorm computes it before its one rounding."""
    return x * _rstd(x, cols, eps) * tl.load(w_ptr + c, mask=inside, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["rows"])  # token counts: one binary for every length
def ffn_inputs(
    h_ptr, a_ptr, wa_ptr, w1_ptr, w2_ptr, ws_ptr, res_ptr, mlp_ptr, exp_ptr, router_ptr, mlp_scale_ptr,
    exp_scale_ptr, mlp_bs_ptr, exp_bs_ptr, rows, cols, CP, eps, root, E2M1_MAX: tl.constexpr,
    E4M3_MAX: tl.constexpr, MLP_FORM: tl.constexpr, EXP_FORM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row of what a layer's FFN branches read: res = h + norm_a(a); then from res's one norm statistic
    the MLP's input norm_1(res), the experts' norm_2(res) and the router's norm(res) * ws * root (unscaled
    norm, two products), each rounded to the row's dtype where torch's kernels round it. The MLP's and the
    experts' inputs are written in the form their GEMMs read (`_ffn_operand`: `MLP_FORM`, `EXP_FORM`)."""
    row = tl.program_id(0).to(tl.int64) * cols
    c = tl.arange(0, BLOCK)
    inside = c < cols
    dt = h_ptr.dtype.element_ty
    a = tl.load(a_ptr + row + c, mask=inside, other=0.0).to(tl.float32)
    na = _rms_norm(a, wa_ptr, c, inside, cols, eps).to(dt).to(tl.float32)
    res = (tl.load(h_ptr + row + c, mask=inside, other=0.0).to(tl.float32) + na).to(dt).to(tl.float32)
    tl.store(res_ptr + row + c, res.to(dt), mask=inside)
    n = res * _rstd(res, cols, eps)
    w1 = tl.load(w1_ptr + c, mask=inside, other=0.0).to(tl.float32)
    w2 = tl.load(w2_ptr + c, mask=inside, other=0.0).to(tl.float32)
    ws = tl.load(ws_ptr + c, mask=inside, other=0.0).to(tl.float32)
    r = tl.program_id(0).to(tl.int64)
    _ffn_operand((n * w1).to(dt), mlp_ptr, mlp_scale_ptr, mlp_bs_ptr, r, rows, cols, CP, c, inside, E2M1_MAX,
                 E4M3_MAX, MLP_FORM, BLOCK)  # fmt: skip
    _ffn_operand((n * w2).to(dt), exp_ptr, exp_scale_ptr, exp_bs_ptr, r, rows, cols, CP, c, inside, E2M1_MAX,
                 E4M3_MAX, EXP_FORM, BLOCK)  # fmt: skip
    scaled = (n.to(dt).to(tl.float32) * ws).to(dt).to(tl.float32)
    tl.store(router_ptr + row + c, (scaled * root).to(dt), mask=inside)


@triton.jit
def layer_end(
    dense_ptr, moe_ptr, res_ptr, w1_ptr, w2_ptr, w_ptr, s_ptr, out_ptr, cols, eps, BLOCK: tl.constexpr
):  # fmt: skip
    """One row of a decoder layer's end, (res + norm(norm1(dense) + norm2(moe))) * s, each norm, the sum, the
    residual sum and the product rounded to the row's dtype where torch's five kernels round them."""
    row = tl.program_id(0).to(tl.int64) * cols
    c = tl.arange(0, BLOCK)
    inside = c < cols
    dt = res_ptr.dtype.element_ty
    dense = tl.load(dense_ptr + row + c, mask=inside, other=0.0).to(tl.float32)
    moe = tl.load(moe_ptr + row + c, mask=inside, other=0.0).to(tl.float32)
    a = _rms_norm(dense, w1_ptr, c, inside, cols, eps).to(dt).to(tl.float32)
    b = _rms_norm(moe, w2_ptr, c, inside, cols, eps).to(dt).to(tl.float32)
    ffn = _rms_norm((a + b).to(dt).to(tl.float32), w_ptr, c, inside, cols, eps).to(dt).to(tl.float32)
    h = (tl.load(res_ptr + row + c, mask=inside, other=0.0).to(tl.float32) + ffn).to(dt).to(tl.float32)
    tl.store(out_ptr + row + c, (h * tl.load(s_ptr).to(tl.float32)).to(dt), mask=inside)


@triton.jit(do_not_specialize=["rows", "seq", "q_rows"])  # token counts: one binary for every length
def head_norms(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, v_ptr, v_out_ptr, rows, heads, x_stride, v_stride, eps,
    seq, out_sb, out_sl, out_sh, q_ptr, q_w_ptr, q_out_ptr, q_rows, q_heads, q_stride, q_out_sb, q_out_sl,
    q_out_sh, HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Programs (i, 0): rows of x [tokens * heads, 2 * HALF] RMS-normed with weight w and rounded to x's
    dtype, then rotated by their token's cos/sin [tokens, 2 * HALF] with `rope`'s arithmetic. Programs (i, 1),
    where the grid has them: rows of v of x's shape normed without a weight. Programs (i, 2), where the grid
    has them: rows of q [tokens * q_heads, 2 * HALF] as x's, with q's weight (attention's q beside its k and
    v: the three in one launch). A token's heads are contiguous in x, v and q, tokens `x_stride`, `v_stride`
    and `q_stride` values apart (columns of one merged projection's output). Batch rows hold `seq` tokens;
    head h of the token at l of batch row b goes to b * out_sb + l * out_sl + h * out_sh of x's and v's
    outputs (contiguous [B, L, H, D], or views of a cache's room) and likewise of q's with its strides
    (contiguous [B, L, H, D] or [B, H, L, D])."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    part = tl.program_id(1)
    if part == 0:
        _rotated_rows(
            x_ptr, w_ptr, out_ptr, r, rows, heads, x_stride, cos_ptr, sin_ptr, eps, seq, out_sb, out_sl, out_sh,
            HALF, HALF_P2,
        )  # fmt: skip
    elif part == 2:
        _rotated_rows(
            q_ptr, q_w_ptr, q_out_ptr, r, q_rows, q_heads, q_stride, cos_ptr, sin_ptr, eps, seq, q_out_sb,
            q_out_sl, q_out_sh, HALF, HALF_P2,
        )  # fmt: skip
    else:
        j = tl.arange(0, HALF_P2)[None, :]
        inside = (r < rows)[:, None] & (j < HALF)
        src = (r // heads)[:, None] * v_stride + (r % heads)[:, None] * (2 * HALF) + j
        lo = tl.load(v_ptr + src, mask=inside, other=0.0).to(tl.float32)
        hi = tl.load(v_ptr + src + HALF, mask=inside, other=0.0).to(tl.float32)
        rstd = _head_rstd(lo, hi, HALF, eps)
        dt = x_ptr.dtype.element_ty
        token = r // heads
        row = ((token // seq) * out_sb + (token % seq) * out_sl + (r % heads) * out_sh)[:, None] + j
        tl.store(v_out_ptr + row, (lo * rstd).to(dt), mask=inside)
        tl.store(v_out_ptr + row + HALF, (hi * rstd).to(dt), mask=inside)


@triton.jit
def _rotated_rows(
    x_ptr, w_ptr, out_ptr, r, rows, heads, stride, cos_ptr, sin_ptr, eps, seq, out_sb, out_sl, out_sh,
    HALF: tl.constexpr, HALF_P2: tl.constexpr,
):  # fmt: skip
    """Rows r of x [tokens * heads, 2 * HALF] (tokens `stride` values apart) RMS-normed with weight w, rounded
    to x's dtype, rotated by their token's cos/sin, stored at out: head h of the token at l of batch row b
    (rows of `seq` tokens) at b * out_sb + l * out_sl + h * out_sh."""
    j = tl.arange(0, HALF_P2)[None, :]
    inside = (r < rows)[:, None] & (j < HALF)
    dt = x_ptr.dtype.element_ty
    src = (r // heads)[:, None] * stride + (r % heads)[:, None] * (2 * HALF) + j
    lo = tl.load(x_ptr + src, mask=inside, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + src + HALF, mask=inside, other=0.0).to(tl.float32)
    rstd = _head_rstd(lo, hi, HALF, eps)
    lo = (lo * rstd * tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    hi = (
        (hi * rstd * tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    )
    tok = (r // heads)[:, None] * (2 * HALF) + j
    out_lo, out_hi = _rotate(lo, hi, cos_ptr, sin_ptr, tok, inside, HALF)
    token = r // heads
    row = ((token // seq) * out_sb + (token % seq) * out_sl + (r % heads) * out_sh)[:, None] + j
    tl.store(out_ptr + row, out_lo, mask=inside)
    tl.store(out_ptr + row + HALF, out_hi, mask=inside)


@triton.jit
def _head_rstd(lo, hi, HALF: tl.constexpr, eps):
    """rsqrt(mean(x^2) + eps) in fp32 of each row [lo | hi] (zeros past HALF): `_rstd` for a block of rows."""
    squares = tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)
    return tl.math.rsqrt(tl.math.div_rn(squares, 2.0 * HALF) + eps)[:, None]


@triton.jit
def norm_fp8(x_ptr, w_ptr, scale_ptr, out_ptr, cols, eps, E4M3_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """One row's RMSNorm with weight w, rounded to x's dtype as torch's fused norm rounds it (`_rms_norm`: but
    for the order of its sum of squares), then its E4M3 codes at the static fp32 scale as
    `kernels.jit.quant.fp8_static_quant` makes them (an IEEE division, a NaN-keeping clamp)."""
    row = tl.program_id(0).to(tl.int64) * cols
    c = tl.arange(0, BLOCK)
    inside = c < cols
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row + c, mask=inside, other=0.0).to(tl.float32)
    n = _rms_norm(x, w_ptr, c, inside, cols, eps).to(dt).to(tl.float32)
    tl.store(out_ptr + row + c, _e4m3(n, scale_ptr, E4M3_MAX), mask=inside)


@triton.jit
def _ffn_operand(
    v, out_ptr, scale_ptr, bs_ptr, r, rows, cols, CP, c, inside, E2M1_MAX: tl.constexpr, E4M3_MAX: tl.constexpr,
    FORM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row r of an FFN input v (rounded to the row's dtype) as its GEMM reads it. FORM 0: the rows; 1: E4M3
    codes at the static scale (`_e4m3`); 2: NVFP4 under the global scale, block scales [rows, cols / 16]
    at bs_ptr; 3: likewise, the block scales swizzled for a linear's FP4 GEMM (`_nvfp4_row`); 4: rounded to
    NVFP4 under the global scale and back to the row's dtype, then E4M3 at the row's own scale, stored at
    bs_ptr [rows] (the Hopper/Ada NVFP4 fallback's operand, as `kernels.jit.quant.nvfp4_fp8_rows`)."""
    if FORM == 0:
        tl.store(out_ptr + r * cols + c, v, mask=inside)
    elif FORM == 1:
        tl.store(out_ptr + r * cols + c, _e4m3(v.to(tl.float32), scale_ptr, E4M3_MAX), mask=inside)
    elif FORM == 4:
        blocks = tl.reshape(v.to(tl.float32), (BLOCK // 16, 16))
        rounded = nvfp4_rounded(blocks, scale_ptr, E2M1_MAX, E4M3_MAX).to(v.dtype).to(tl.float32)
        codes, row_scale = fp8_of_row(rounded, E4M3_MAX)
        tl.store(out_ptr + r * cols + c, tl.reshape(codes, (BLOCK,)), mask=inside)
        tl.store(bs_ptr + r, row_scale)
    else:
        _nvfp4_row(v.to(tl.float32), r, rows, cols, 0, scale_ptr, out_ptr, bs_ptr, CP, FORM == 3, E2M1_MAX,
                   E4M3_MAX, BLOCK)  # fmt: skip


@triton.jit
def _e4m3(v, scale_ptr, E4M3_MAX: tl.constexpr):
    """E4M3 codes of fp32 values v at the static fp32 scale, as `kernels.jit.quant.fp8_static_quant` makes
    them: an IEEE division, a NaN-keeping clamp, the round-to-nearest conversion."""
    v = tl.math.div_rn(v, tl.load(scale_ptr).to(tl.float32))
    return e4m3(tl.clamp(v, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL))


@triton.jit(do_not_specialize=["rows"])  # token counts: one binary for every length
def norm_nvfp4(
    x_ptr, w_ptr, gs_ptr, packed_ptr, scales_ptr, normed_ptr, rows, cols, CP, eps, E2M1_MAX: tl.constexpr,
    E4M3_MAX: tl.constexpr, WRITE_NORMED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row's RMSNorm as `norm_fp8` computes it, then its NVFP4 under the global scale as
    `kernels.jit.quant.nvfp4_quant_blocked` makes it, code for code: E2M1 codes in pairs [rows, cols / 2],
    block scales at `blocked_index` in the layout of [rows padded to 128, CP] a linear's FP4 GEMM reads, the
    padding's zeros included (the launch covers the padded rows; BLOCK / 16 >= CP). `WRITE_NORMED`: the
    normed row too (the load-time probe's view of what was quantized)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = (c < cols) & (tl.zeros_like(c) + r < rows)  # (a row past `rows`: padding, zero scales)
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * cols + c, mask=inside, other=0.0).to(tl.float32)
    n = _rms_norm(x, w_ptr, c, inside, cols, eps).to(dt)
    if WRITE_NORMED:
        tl.store(normed_ptr + r * cols + c, n, mask=inside)
    _nvfp4_row(n.to(tl.float32), r, rows, cols, 0, gs_ptr, packed_ptr, scales_ptr, CP, True, E2M1_MAX, E4M3_MAX,
               BLOCK)  # fmt: skip


@triton.jit
def _nvfp4_row(
    v, r, rows, cols, c0, gs_ptr, packed_ptr, scales_ptr, CP, BLOCKED: tl.constexpr, E2M1_MAX: tl.constexpr,
    E4M3_MAX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row r's fp32 values v [BLOCK] from column c0 (zeros past `cols`) as NVFP4 under the global scale, as
    `kernels.jit.quant.nvfp4_quant` makes them: E2M1 codes in pairs [rows, cols / 2]; block scales
    [rows, cols / 16], or (BLOCKED) at `blocked_index` in the layout of [rows padded to 128, CP] a linear's FP4
    GEMM reads, the padded columns' zeros included (the blocks past `cols` a launch reaches cover CP; a row
    past `rows` writes zero scales)."""
    even, odd = tl.split(tl.reshape(v, (BLOCK // 16, 8, 2)))  # each block's even and odd columns
    codes, bs = nvfp4_encode(even, odd, gs_ptr, E2M1_MAX, E4M3_MAX)
    pair = c0 // 2 + tl.arange(0, BLOCK // 2)
    live = (pair < cols // 2) & (tl.zeros_like(pair) + r < rows)
    tl.store(packed_ptr + r * (cols // 2) + pair, tl.reshape(codes, (BLOCK // 2,)), mask=live)
    cb = c0 // 16 + tl.arange(0, BLOCK // 16)  # scale columns
    real = (cb < cols // 16) & (tl.zeros_like(cb) + r < rows)
    if BLOCKED:
        bits = tl.where(real, bs.to(tl.uint8, bitcast=True), 0)
        tl.store(scales_ptr + blocked_index(r, cb, CP), bits, mask=cb < CP)
    else:
        tl.store(scales_ptr + r * (cols // 16) + cb, bs, mask=real)
