"""The network's element-wise chains on CUDA as one Triton kernel each: RoPE (`rope`, what
`pipeline.model.network.apply_rope` computes; with the q, k and v norms before it, `head_norms`), the final
logits' softcap (`softcap`, what `DiffusionGemma.logits` computes after the LM head), the routed experts'
combine (`combine`, what `network.combine_top_k` computes), the gated GeLU of the MLPs and experts (`geglu`,
`network.geglu`), a layer's residual sum and output scale (`add_scaled`), attention's K/V concatenation
(`kv_cat`), the router's input scales (`scale_columns`), the norms and sums before and after a layer's
FFN branches (`ffn_inputs`, `layer_end`: `network.ffn_inputs`, `network.layer_end`), and a layer's input
norm written as its FP8 q|k|v operand (`norm_fp8`). Each chain is several kernels eagerly, each a pass
through memory and a launch of a few microseconds even inside a CUDA graph.

RoPE: rotating q or k is five kernels (x * cos, the negation and concatenation of `rotate_half`, its product
with sin, the sum), ten launches a layer, ~300 of the ~2,100 in one FP8 26B pass (`dgpipe bench gpu-trace`).
One program here rotates a block of (token, head) rows, reading x and its token's cos/sin once. Each product
and the sum are rounded to x's dtype exactly where torch's kernels round them (a product of two bf16 or fp16
values is exact in fp32), so the result is torch's bit for bit: the unit tests hold it to the torch form in
Triton's interpreter (with round-to-nearest-even casts) and compile it for sm_90a, sm_100a, sm_89 and sm_120
with no fused multiply-add (`OPTIONS`). bf16 and fp16 only.

Head norms: before RoPE each q and k head is RMS-normed with its weight, and each v head without one: three
norms and two rotations a layer, five launches, the normed q and k written and read back. One launch here
norms and rotates q's rows, another k's and v's (a second axis of programs takes v): each norm is torch's
fused RMSNorm arithmetic but for the order of its sum of squares (as in `layer_end` below), rounded to the
input's dtype, then rotated with the RoPE kernel's arithmetic (`probe.norms.same_rotation`).

Softcap: the LM head's bf16 logits are widened to fp32, divided by the cap, put through tanh and multiplied
by it: four passes over [tokens, 262,144] values (at 16 canvases 4.3 GB of fp32 each, ~17 GB of traffic a
pass on top of the one pass that must write them). The kernel reads the bf16 logits once and writes the fp32
ones once, with torch's CUDA arithmetic: the division as a product with the cap's fp32 reciprocal (how
torch's CUDA kernel divides by a scalar) and tanh from CUDA's libdevice.

Combine: each token's k expert outputs were gathered back from expert order to slot order (a copy of every
slot's row) and summed by cuBLAS's batched product (on an H200 at 16 canvases the two ran far below HBM
speed: 9.5 ms a pass). The kernel reads each token's rows where they are and sums them in fp32 in slot
order: bit for bit its torch form `sequential_combine`, and the batched product within bf16 rounding (cuBLAS
sums in another order).

Gated GeLU: torch computes `gelu_tanh(gate) * up` in two kernels, and the FP8 experts quantize the product
for the down projection in a third; at 16 canvases the 26B's experts move ~0.3 GB a layer through the three.
The kernel reads gate and up once (the two halves of the gate|up GEMM's output, where they are) and writes
the product, or its E4M3 codes. It computes what torch's CUDA kernels compute (`GeluCUDAKernelImpl`: the
GeLU in fp32 with the one fused multiply-add nvcc makes of `x + kKappa * x_cube`, rounded to the input's
dtype, then the product rounded), with libdevice's tanh, the function CUDA's `tanhf` is. In Triton's
interpreter (numpy's tanh standing in) it is that arithmetic bit for bit; the probe, which cannot know which
tanh this torch build was compiled against, allows another tanh's rounding (`probe.chains.same_geglu`: in the
negative tail `1 + tanh` cancels, so one fp32 ulp of the tanh there is the whole value).

K/V concatenation: a pass over cached tokens concatenates each layer's cached K and V with the new ones, two
`torch.cat` launches; on an H200 at 16 canvases torch's 120 concatenations of a pass (half of them
`rotate_half`'s) took 7.3 ms for about 7 GB, some 1 TB/s. The kernel copies K's and V's rows, from wherever
the cache's views and the projections' transposed outputs lie, in one launch: a copy, so torch's bit for bit.
Denoise passes over a cache with room for their canvas concatenate nothing (`network.PastWithRoom`: the
head-norms kernel writes the canvas's K/V into the cache's buffers); prefill chunks and commits still do.

Residual sum: a decoder layer ends with `(residual + x) * layer_scalar`, two kernels; this is one, rounding
the sum before the product as torch does, so bit for bit. Layer end: before that sum come three RMSNorms and a
sum (`network.layer_end`: `norm(norm_1(dense) + norm_2(moe))`), five kernels in all, each intermediate written
and read back; one program here takes a row through all of them, each result rounded where torch rounds it.
FFN inputs: after attention, a norm and the residual sum, then the dense MLP's, the experts' and the router's
norms of that residual and the router's two products (`network.ffn_inputs`), six kernels; one here, with one
norm statistic for the three norms of the residual.
The norms compute torch's fused RMSNorm arithmetic (fp32, `x * rsqrt(mean(x^2) + eps) * w`, rounded once)
but add their squares in another order, so a value can land one rounding away (`probe.common.same_layer_end`; under
1% of values in the tests, none in most bf16 rows). The router's input, `norm(x) * scale * d^-0.5`,
is likewise two products in one kernel, each rounded where torch rounds it. Norm to FP8: with FP8 linears,
q, k and v read one E4M3 operand of the layer's normed input, and nothing else reads the normed rows, so one
kernel norms a row (as `layer_end`'s norms) and writes its codes as `kernels.quant.fp8` would
(`probe.norms.same_fp8_of_norm`: a code one E4M3 step away where the normed value is one rounding away).

The load-time probe holds each to its torch form on the GPU before a model uses it
(`pipeline.runtime.probe.check_triton_rope`, `check_triton_softcap`, `check_triton_combine`,
`check_triton_geglu`, `check_triton_residual`, `check_triton_kv_cat`, `check_triton_router`,
`check_triton_layer_end`, `check_triton_ffn_inputs`, `check_triton_head_norms`, `check_triton_norm_fp8`).
Under torch.compile the torch forms stay (inductor fuses them).
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from pipeline.model import network
from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK
from pipeline.model.network import DecoderLayer, RMSNorm, apply_rope, gelu_tanh
from pipeline.runtime.kernels import quant

FfnInput = torch.Tensor | sl.QuantizedRows  # an FFN branch's input: rows, or their operand (`ffn_inputs`)
# ("fp8" | "nvfp4" | "fp8_rowwise", the GEMM's static input scale or NVFP4 global scale)
OperandForm = tuple[str, torch.Tensor]
ROW_VALUES = 4096  # values per program: 16 rows of a 256-wide head, 8 of a 512-wide one
# no floating-point contraction: with it (Triton's default) LLVM turns a product and the sum it feeds into
# one fused multiply-add, rounding once where torch rounds twice (seen in the PTX for sm_90a: fma.rn.bf16)
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    """The jitted kernels, imported on first use (Triton reads TRITON_INTERPRET when `jit` wraps them)."""
    from pipeline.runtime.kernels.jit import chains as jit_chains

    return jit_chains


def rope_serves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes x [B, L, H, D] with cos/sin [B, L, D]: bf16/fp16, D even, all contiguous and
    of one dtype (anything else keeps the torch form)."""
    return _rotates(x, cos, sin) and x.is_contiguous()


def _rotates(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [B, L, H, D] and cos, sin [B, L, D] as the rotating kernels take them, x at any strides: the
    kernels read sin at cos's offsets, so both tables are checked (torch's form would broadcast either)."""
    if x.dim() != 4 or x.dtype not in DTYPES:
        return False
    d = x.shape[-1]
    return (
        d > 0
        and d % 2 == 0
        and all(t.dtype == x.dtype and t.shape == (*x.shape[:2], d) and t.is_contiguous() for t in (cos, sin))
    )


def _row_weight(w: torch.Tensor | None, dtype: torch.dtype, d: int) -> bool:
    """Whether the row kernels can read `w` as a norm's or scale's weight over d columns: d values of
    `dtype`, contiguous (they read it at w_ptr + column)."""
    return w is not None and w.dtype == dtype and w.shape == (d,) and w.is_contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D] rotated by cos/sin [B, L, D] (`rope_serves` must hold): x * cos + rotate_half(x) * sin."""
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
    """`rope` where it serves (`rope_serves`), else the torch form: what the GPU loader installs as the layers' RoPE."""
    return rope(x, cos, sin) if rope_serves(x, cos, sin) else apply_rope(x, cos, sin)


# values per program: 8 rows of a 256-wide head, 4 of a 512-wide one (at 16 rows of 256, sm_120 spills)
HEAD_NORMS_VALUES = 2048


def head_norms_serves(
    x: torch.Tensor,
    norm: RMSNorm,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    v_norm: RMSNorm | None = None,
) -> bool:
    """Whether the kernel takes q or k heads x [B, L, H, D] (as `rope_serves` does, but its tokens may lie
    one stride apart: `token_rows`) with their norm (weights of x's dtype), and v [B, L, H, D] of x's shape
    and dtype, its tokens likewise, with its unscaled norm of the same eps (or neither)."""
    return (
        _rotates(x, cos, sin)
        and token_rows(x)
        and _row_weight(norm.weight, x.dtype, x.shape[-1])
        and (v is None) == (v_norm is None)
        and (
            v is None
            or (v.shape == x.shape and v.dtype == x.dtype and token_rows(v) and v_norm.weight is None
                and v_norm.eps == norm.eps)
        )
    )  # fmt: skip


def token_rows(x: torch.Tensor) -> bool:
    """Whether x [B, L, H, D] holds each token's heads contiguous and its B * L tokens one stride apart (a
    contiguous tensor, or q's, k's or v's columns of one merged projection's output)."""
    return (
        x.dim() == 4
        and x.stride(3) == 1
        and x.stride(2) == x.shape[3]
        and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1))
    )


def head_norms(
    x: torch.Tensor,
    norm: RMSNorm,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    v_norm: RMSNorm | None = None,
    q: torch.Tensor | None = None,
    q_norm: RMSNorm | None = None,
    q_head_major: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(rope(norm(x)), v_norm(v) or None, rope(q_norm(q)) or None) in one launch (`head_norms_serves` must
    hold, for q with x's tokens, head dim and dtype as well; q comes with v, whose programs precede q's in the
    grid): attention's k and v, or q, or the three, normed
    per head, k and q rotated. Each norm is torch's fused RMSNorm arithmetic but for the order of its sum of
    squares, rounded to x's dtype; the rotation is `rope`'s, bit for bit on that. Each part's values are the
    ones it gets in a launch of its own. The outputs are contiguous [B, L, H, D], q's [B, H, L, D] where
    `q_head_major` (what `network.attend_packed` reads without a copy), and k's and v's the given `out`
    [B, H, L, D] where given (`head_outputs_serve`: a cache's room, `network.room_for`), written where they
    lie."""
    import triton

    if q is not None and v is None:
        raise ValueError("head_norms takes q in k's and v's launch: pass v too, or q alone as x")
    if out is not None and v is None:
        raise ValueError("head_norms writes k and v into `out`: pass v too")
    b, seq, heads, d = x.shape
    k_out, v_out = out or (torch.empty_like(x, memory_format=torch.contiguous_format), None)
    if out is None and v is not None:
        v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    q_out = None
    if q is not None:
        q_shape = (b, q.shape[2], seq, d) if q_head_major else q.shape
        q_out = torch.empty(q_shape, dtype=q.dtype, device=q.device)
    rows = x.numel() // d
    q_rows = 0 if q is None else q.numel() // d
    if rows or q_rows:
        half = triton.next_power_of_2(d // 2)
        block = max(1, HEAD_NORMS_VALUES // (2 * half))
        v_in, q_in = x if v is None else v, x if q is None else q
        parts = 3 if q is not None else 2 if v is not None else 1
        q_weight = norm.weight if q_norm is None else q_norm.weight
        q_strides = _head_strides(q_out, q_head_major) if q_out is not None else (0, 0, 0)
        _kernels().head_norms[(triton.cdiv(max(rows, q_rows), block), parts)](
            x, norm.weight, cos, sin, k_out, v_in, k_out if v_out is None else v_out, rows, heads, x.stride(1),
            v_in.stride(1), norm.eps, max(seq, 1), *_head_strides(k_out, out is not None), q_in, q_weight,
            k_out if q_out is None else q_out, q_rows, q_in.shape[2], q_in.stride(1), *q_strides, HALF=d // 2,
            HALF_P2=half, BLOCK_R=block, **OPTIONS,
        )  # fmt: skip
    return k_out, v_out, q_out


def _head_strides(out: torch.Tensor, head_major: bool) -> tuple[int, int, int]:
    """The strides of a batch row, a token and a head of an output [B, L, H, D], or [B, H, L, D] where
    `head_major`."""
    if head_major:
        return out.stride(0), out.stride(2), out.stride(1)
    return out.stride(0), out.stride(1), out.stride(2)


def head_outputs_serve(
    out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, v: torch.Tensor | None
) -> bool:
    """Whether the kernel writes k's and v's heads into `out` ([B, H, L, D] each, of x's dtype, laid out
    alike, each head's values contiguous: a cache's room) for x [B, L, H, D] and its v."""
    b, seq, heads, d = x.shape
    return v is not None and all(
        t.shape == (b, heads, seq, d)
        and t.dtype == x.dtype
        and t.stride(3) == 1
        and t.stride() == out[0].stride()
        for t in out
    )


def head_norms_or_torch(
    x: torch.Tensor,
    norm: RMSNorm,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    v_norm: RMSNorm | None = None,
    q: torch.Tensor | None = None,
    q_norm: RMSNorm | None = None,
    q_head_major: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`head_norms` where it serves (`head_norms_serves`, q's too, `out`'s too), else the torch form (q
    [B, H, L, D] then a transposed view, where `q_head_major`; k and v copied into `out`, where given): what
    the GPU loader installs."""
    serves = (
        head_norms_serves(x, norm, cos, sin, v, v_norm)
        and (q is None or (v is not None and _q_beside(q, q_norm, x, norm, cos, sin)))
        and (out is None or head_outputs_serve(out, x, v))
    )
    if serves:
        return head_norms(x, norm, cos, sin, v, v_norm, q, q_norm, q_head_major, out)
    normed_k = apply_rope(norm(x), cos, sin)
    normed_v = v_norm(v) if v is not None and v_norm is not None else None
    normed_q = apply_rope(q_norm(q), cos, sin) if q is not None and q_norm is not None else None
    if normed_q is not None and q_head_major:
        normed_q = normed_q.transpose(1, 2)
    if out is not None and normed_v is not None:
        out[0].copy_(normed_k.transpose(1, 2))
        out[1].copy_(normed_v.transpose(1, 2))
        return out[0], out[1], normed_q
    return normed_k, normed_v, normed_q


def _q_beside(
    q: torch.Tensor,
    q_norm: RMSNorm | None,
    x: torch.Tensor,
    norm: RMSNorm,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Whether q's heads go in x's launch (x being k, with v beside it): the kernel takes them alone, with x's
    tokens, head dim, dtype and eps."""
    return (
        q_norm is not None
        and head_norms_serves(q, q_norm, cos, sin)
        and q.shape[:2] == x.shape[:2]
        and q.shape[3] == x.shape[3]
        and q.dtype == x.dtype
        and q_norm.eps == norm.eps
    )


SOFTCAP_BLOCK = 4096  # logits per program


def fp32(v: float) -> float:
    """v rounded to the nearest fp32 value (as C converts a double to float)."""
    return struct.unpack("f", struct.pack("f", v))[0]


@functools.cache
def fp32_reciprocal(x: float) -> float:
    """1 / x in fp32 arithmetic, as torch's CUDA kernel computes the reciprocal of a scalar divisor: the
    quotient of the fp32 values in double, rounded to fp32 (correctly rounded: 53 >= 2 * 24 + 2 bits)."""
    return fp32(1.0 / fp32(x))


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """fp32 tanh(logits / cap) * cap in one pass over the LM head's output (any float dtype, contiguous)."""
    import triton

    x = logits.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _kernels().softcap[(triton.cdiv(n, SOFTCAP_BLOCK),)](
            x, out, n, fp32_reciprocal(cap), cap, BLOCK=SOFTCAP_BLOCK, **OPTIONS
        )
    return out


COMBINE_BLOCK = 1024  # output values per program (a token's row of the 26B is 2,816)


def combine(y: torch.Tensor, rows: torch.Tensor | None, weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs weighted and summed in one pass: token t's j-th slot is y[rows[t * k + j]]
    (rows: the inverse of the expert order; None: y already in token-major slot order). What
    `network.combine_slots` computes up to the fp32 summation order (`sequential_combine` is this kernel's
    exact torch form), without first copying the rows to slot order."""
    import triton

    t, k = weights.shape
    d = y.shape[1]
    y = y if y.stride(-1) == 1 else y.contiguous()
    out = torch.empty(t, d, dtype=y.dtype, device=y.device)
    if t and d:  # the kernel reads rows[t * k + j] and weights[t, j] at those offsets
        _kernels().combine[(t, triton.cdiv(d, COMBINE_BLOCK))](
            y, (rows if rows is not None else weights).contiguous(), weights.contiguous(), out, d, y.stride(0),
            K=k, GATHER=rows is not None, BLOCK_D=COMBINE_BLOCK, **OPTIONS,
        )  # fmt: skip
    return out


def sequential_combine(y: torch.Tensor, rows: torch.Tensor | None, weights: torch.Tensor) -> torch.Tensor:
    """`combine` in torch ops: the weights rounded to y's dtype, products and sums in fp32 in slot order."""
    t, k = weights.shape
    per_slot = (y if rows is None else y.index_select(0, rows)).view(t, k, -1).float()
    w = weights.to(y.dtype).float()
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(k):
        acc = acc + w[:, j, None] * per_slot[:, j]
    return acc.to(y.dtype)


# torch's `GeluCUDAKernelImpl` constants for fp32 math (aten/src/ATen/native/cuda/ActivationGeluKernel.cu):
# kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 evaluated in double, then stored as float; kKappa = 0.044715 as float
GELU_BETA = fp32(1.41421356237309504880 * 1.12837916709551257390 * 0.5)
GELU_KAPPA = fp32(0.044715)
GEGLU_BLOCK = 1024  # values per program: a row of the 26B's experts (704), a third of its dense MLP's (2,112)


def geglu_serves(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes gate and up: one shape and dtype (bf16/fp16), each row contiguous."""
    return (
        gate.dtype in DTYPES
        and up.dtype == gate.dtype
        and gate.shape == up.shape
        and gate.dim() >= 1
        and gate.stride(-1) == 1
        and up.stride(-1) == 1
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] with contiguous rows: a view for a contiguous tensor or the gate|up halves of one."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def geglu(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up in one pass (`geglu_serves` must hold), as torch's CUDA kernels compute it: the
    GeLU rounded to gate's dtype, then the product rounded. `scale`: instead, that product's E4M3 codes at
    this static fp32 scale, what `kernels.quant.fp8` (`scaled_layout.fp8_quantize`) would make of it."""
    import triton

    g, u = _rows(gate), _rows(up)
    rows, cols = g.shape
    dtype = gate.dtype if scale is None else torch.float8_e4m3fn
    out = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    if rows and cols:
        block = min(GEGLU_BLOCK, triton.next_power_of_2(cols))
        _kernels().geglu[(rows, triton.cdiv(cols, block))](
            g, u, g if scale is None else scale, out, cols, g.stride(0), u.stride(0), BETA=GELU_BETA,
            KAPPA=GELU_KAPPA, E4M3_MAX=E4M3_MAX, QUANT=scale is not None, BLOCK=block, **OPTIONS,
        )  # fmt: skip
    return out


def geglu_nvfp4(
    gate: torch.Tensor, up: torch.Tensor, global_scale: torch.Tensor, blocked: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`geglu`'s product as NVFP4 in the same pass (`geglu_serves` must hold, and a row's width be a multiple
    of 16): (codes packed in pairs, uint8 [..., cols / 2]; E4M3 block scales [..., cols / 16]), what
    `scaled_layout.nvfp4_quantize` makes of the product, or with `blocked` the scales as a linear's FP4 GEMM
    reads them (`scaled_layout.to_blocked` of [rows, cols / 16]: flat uint8, padding zero), what
    `kernels.quant.nvfp4_blocked` writes. The down projection's operand in one launch where two read and
    write the product."""
    import triton

    g, u = _rows(gate), _rows(up)
    rows, cols = g.shape
    c = cols // NVFP4_BLOCK
    padded, cp = sl.blocked_shape(rows, c)
    padded = padded if blocked else rows
    packed = torch.empty(*gate.shape[:-1], cols // 2, dtype=torch.uint8, device=gate.device)
    if blocked:
        scales = torch.empty(padded * cp, dtype=torch.uint8, device=gate.device)
    else:
        scales = torch.empty(*gate.shape[:-1], c, dtype=torch.float8_e4m3fn, device=gate.device)
    if padded and cols:
        block = min(GEGLU_BLOCK, max(64, triton.next_power_of_2(cols)))  # >= 4 scale columns a program
        _kernels().geglu_nvfp4[(padded, triton.cdiv(cols, block))](
            g, u, global_scale, packed, scales, rows, cols, g.stride(0), u.stride(0), cp, BETA=GELU_BETA,
            KAPPA=GELU_KAPPA, E2M1_MAX=E2M1_MAX, E4M3_MAX=E4M3_MAX, BLOCKED=blocked, BLOCK=block, **OPTIONS,
        )  # fmt: skip
    return packed, scales


def geglu_nvfp4_or_torch(
    gate: torch.Tensor, up: torch.Tensor, global_scale: torch.Tensor, blocked: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`geglu_nvfp4` where it serves, else the torch form: what the GPU loader installs."""
    if geglu_serves(gate, up) and gate.shape[-1] % NVFP4_BLOCK == 0:
        return geglu_nvfp4(gate, up, global_scale, blocked)
    packed, scales = sl.nvfp4_quantize(gelu_tanh(gate) * up, global_scale)
    return packed, sl.to_blocked(
        scales.reshape(-1, scales.shape[-1]).view(torch.uint8)
    ) if blocked else scales


def geglu_or_torch(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`geglu` where it serves (`geglu_serves`), else the torch form: what the GPU loader installs."""
    if geglu_serves(gate, up):
        return geglu(gate, up, scale)
    h = gelu_tanh(gate) * up
    return h if scale is None else sl.fp8_quantize(h, scale)


ADD_SCALED_BLOCK = 4096  # values per program


def add_scaled_serves(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the kernel takes a + b times a one-value scale: all one dtype (bf16/fp16), a and b one shape,
    contiguous, the scale of no more dimensions than they have (torch's form would broadcast the sum up)."""
    return (
        a.dtype in DTYPES
        and b.dtype == a.dtype
        and scale.dtype == a.dtype
        and scale.numel() == 1
        and scale.dim() <= a.dim()
        and a.shape == b.shape
        and a.is_contiguous()
        and b.is_contiguous()
    )


def add_scaled(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(a + b) * scale in one pass (`add_scaled_serves` must hold): a decoder layer's residual sum and its
    output scale, the sum rounded to a's dtype before the product, as torch's two kernels compute them."""
    import triton

    out = torch.empty_like(a)
    n = a.numel()
    if n:
        _kernels().add_scaled[(triton.cdiv(n, ADD_SCALED_BLOCK),)](
            a, b, scale, out, n, BLOCK=ADD_SCALED_BLOCK, **OPTIONS
        )
    return out


def add_scaled_or_torch(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`add_scaled` where it serves (`add_scaled_serves`), else the torch form: what the GPU loader installs."""
    return add_scaled(a, b, scale) if add_scaled_serves(a, b, scale) else (a + b) * scale


# the row kernels (`layer_end`, `ffn_inputs`): one row a program, in registers (the 26B's 2,816 wide)
ROW_MAX_COLS = 8192
ROW_OPTIONS = {**OPTIONS, "num_warps": 8}  # a 4,096-wide row: 16 values a thread


def layer_end_serves(
    residual: torch.Tensor,
    dense: torch.Tensor,
    moe: torch.Tensor,
    norms: tuple[RMSNorm, ...],
    scale: torch.Tensor,
) -> bool:
    """Whether the kernel takes a layer's end: residual, dense and moe [..., d] of one dtype (bf16/fp16) and
    shape, contiguous, d at most `ROW_MAX_COLS`; the three norms scaled by weights of that dtype, one eps;
    a one-value scale."""
    d = residual.shape[-1]
    return (
        residual.dtype in DTYPES
        and all(
            t.dtype == residual.dtype and t.shape == residual.shape and t.is_contiguous()
            for t in (dense, moe)
        )
        and residual.is_contiguous()
        and d <= ROW_MAX_COLS
        and all(_row_weight(n.weight, residual.dtype, d) for n in norms)
        and len({n.eps for n in norms}) == 1
        and scale.dtype == residual.dtype
        and scale.numel() == 1
    )


def layer_end(
    residual: torch.Tensor,
    dense: torch.Tensor,
    moe: torch.Tensor,
    norms: tuple[RMSNorm, ...],
    scale: torch.Tensor,
) -> torch.Tensor:
    """`pipeline.model.network.layer_end` in one pass over each row (`layer_end_serves` must hold): the three
    RMSNorms in fp32 as torch's fused norm computes them but for the order of their sums of squares, and every
    result rounded where torch's kernels round it."""
    import triton

    out = torch.empty_like(residual)
    d = residual.shape[-1]
    rows = residual.numel() // d if d else 0
    if rows:
        w1, w2, w = (n.weight for n in norms)
        _kernels().layer_end[(rows,)](
            dense, moe, residual, w1, w2, w, scale, out, d, norms[0].eps, BLOCK=triton.next_power_of_2(d),
            **ROW_OPTIONS,
        )  # fmt: skip
    return out


def layer_end_or_torch(
    residual: torch.Tensor,
    dense: torch.Tensor,
    moe: torch.Tensor,
    norms: tuple[RMSNorm, ...],
    scale: torch.Tensor,
) -> torch.Tensor:
    """`layer_end` where it serves (`layer_end_serves`), else the torch form: what the GPU loader installs."""
    if layer_end_serves(residual, dense, moe, norms, scale):
        return layer_end(residual, dense, moe, norms, scale)
    return network.layer_end(residual, dense, moe, norms, scale)


def ffn_inputs_serves(layer: DecoderLayer, h: torch.Tensor, attn: torch.Tensor) -> bool:
    """Whether the kernel takes a layer's FFN inputs: h and the attention output [..., d] of one dtype
    (bf16/fp16) and shape, contiguous, d at most `ROW_MAX_COLS`; the four norms of that width and eps,
    the three that scale with weights of that dtype, the router's unscaled; its scales of that dtype."""
    d = h.shape[-1]
    scaled = (
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        layer.pre_feedforward_layernorm_2,
    )
    router = layer.router
    return (
        h.dtype in DTYPES
        and attn.dtype == h.dtype
        and attn.shape == h.shape
        and h.is_contiguous()
        and attn.is_contiguous()
        and d <= ROW_MAX_COLS
        and all(_row_weight(n.weight, h.dtype, d) for n in scaled)
        and router.norm.weight is None
        and _row_weight(router.scale, h.dtype, d)
        and len({n.eps for n in (*scaled, router.norm)}) == 1
    )


def ffn_inputs(
    layer: DecoderLayer,
    h: torch.Tensor,
    attn: torch.Tensor,
    mlp_form: OperandForm | None = None,
    experts_form: OperandForm | None = None,
) -> tuple[torch.Tensor, FfnInput, FfnInput, torch.Tensor]:
    """`pipeline.model.network.ffn_inputs` in one pass over each row (`ffn_inputs_serves` must hold): two norm
    statistics (the attention output's, the residual's) where torch's form computes five, in fp32 as torch's
    fused RMSNorm but for the order of the sums of squares, every result rounded where torch rounds it.

    `mlp_form`, `experts_form`: that input comes as the operand its GEMM's own one-pass quantization makes of
    the rounded rows, code for code (`scaled_layout.QuantizedRows`, for a GEMM that reads it so:
    `gpu_load.ffn_inputs_for`). ("fp8", static scale): E4M3 codes as `kernels.quant.fp8` writes them;
    ("nvfp4", global scale): E2M1 codes in pairs and block scales as `kernels.quant.nvfp4` writes them for
    the experts, and swizzled as `kernels.quant.nvfp4_blocked` writes them for the dense MLP's linear, where
    its rows fill whole 128-row tiles (else the rows, which the linear quantizes itself; so too for rows of
    no whole 16-value blocks); ("fp8_rowwise", global scale): the Hopper/Ada NVFP4 fallback's E4M3 codes of
    the NVFP4-rounded rows and their per-row scales, as `kernels.quant.nvfp4_fp8_rows` writes them."""
    import triton

    d = h.shape[-1]
    rows = h.numel() // d if d else 0
    blocks = lambda form: form is not None and form[0] != "fp8"  # NVFP4 blocks: whole ones only
    if blocks(mlp_form) and (d % NVFP4_BLOCK or (mlp_form[0] == "nvfp4" and rows % sl.TILE_ROWS)):
        mlp_form = None  # (and the kernel writes no padding rows' swizzled scales)
    if blocks(experts_form) and d % NVFP4_BLOCK:
        experts_form = None
    cp = sl.blocked_shape(rows, d // NVFP4_BLOCK)[1]
    residual = torch.empty_like(h)
    router_in = torch.empty(rows, d, dtype=h.dtype, device=h.device)
    mlp_in, mlp_bs = _operand_buffers(mlp_form, h.shape, cp, True, h)
    experts_in, experts_bs = _operand_buffers(experts_form, (rows, d), cp, False, h)
    if rows:
        norms = (
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.pre_feedforward_layernorm_2,
        )
        unread = layer.router.scale  # a pointer the kernel does not read
        scale = lambda form: unread if form is None else form[1]
        _kernels().ffn_inputs[(rows,)](
            h, attn, *(n.weight for n in norms), layer.router.scale, residual, mlp_in, experts_in, router_in,
            scale(mlp_form), scale(experts_form), unread if mlp_bs is None else mlp_bs,
            unread if experts_bs is None else experts_bs, rows, d, cp, norms[0].eps, layer.router.root,
            E2M1_MAX=E2M1_MAX, E4M3_MAX=E4M3_MAX, MLP_FORM=_FFN_FORMS[mlp_form and mlp_form[0], True],
            EXP_FORM=_FFN_FORMS[experts_form and experts_form[0], False],
            BLOCK=max(64, triton.next_power_of_2(d)), **ROW_OPTIONS,  # 64: 4 block scales, a swizzled tile's width
        )  # fmt: skip
    return (
        residual,
        _wrapped(mlp_in, mlp_bs, mlp_form, True, h),
        _wrapped(experts_in, experts_bs, experts_form, False, h),
        router_in,
    )


# (form, whether the operand is a linear's) -> the ffn_inputs kernel's FORM: the rows, E4M3, NVFP4 with its
# block scales as the experts read them or swizzled for a linear
_FFN_FORMS = {(None, True): 0, (None, False): 0, ("fp8", True): 1, ("fp8", False): 1, ("nvfp4", False): 2,
              ("nvfp4", True): 3, ("fp8_rowwise", True): 4, ("fp8_rowwise", False): 4}  # fmt: skip


def _operand_buffers(
    form: OperandForm | None, shape: tuple[int, ...], cp: int, linear: bool, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the ffn_inputs kernel writes one FFN input to, in `form`: (rows or codes, block scales or None)."""
    if form is None:
        return torch.empty(shape, dtype=h.dtype, device=h.device), None
    rows, d = math.prod(shape[:-1]), shape[-1]
    if form[0] in ("fp8", "fp8_rowwise"):
        row_scales = (
            torch.empty(rows, dtype=torch.float32, device=h.device) if form[0] == "fp8_rowwise" else None
        )
        return torch.empty(shape, dtype=torch.float8_e4m3fn, device=h.device), row_scales
    codes = torch.empty(*shape[:-1], d // 2, dtype=torch.uint8, device=h.device)
    if linear:  # swizzled, rows in whole tiles (`ffn_inputs`)
        return codes, torch.empty(rows * cp, dtype=torch.uint8, device=h.device)
    return codes, torch.empty(rows, d // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=h.device)


def _wrapped(
    out: torch.Tensor, bs: torch.Tensor | None, form: OperandForm | None, linear: bool, h: torch.Tensor
) -> FfnInput:
    """One FFN input as its consumer reads it: the rows, or the operand and scales its own quantization
    gives (`ScaledLinear.quantize`, `tensor_cores.quantize_rows`)."""
    if form is None:
        return out
    kind, scale = form
    if kind == "fp8":
        scales = (scale,) if linear else (scale.float().expand(out.shape[0]),)
    elif kind == "fp8_rowwise":  # per-row scales: [M, 1] for a linear's RowWise GEMM, [M] for the experts'
        scales = (bs[:, None],) if linear else (bs,)
    else:
        scales = (bs.view(torch.float8_e4m3fn), scale) if linear else (bs,)
    return sl.QuantizedRows(out, scales, h.dtype)


def ffn_inputs_or_torch(
    layer: DecoderLayer,
    h: torch.Tensor,
    attn: torch.Tensor,
    mlp_form: OperandForm | None = None,
    experts_form: OperandForm | None = None,
) -> tuple[torch.Tensor, FfnInput, FfnInput, torch.Tensor]:
    """`ffn_inputs` where it serves (`ffn_inputs_serves`), else the torch form (its rows, which their GEMMs
    quantize themselves): what the GPU loader installs."""
    if ffn_inputs_serves(layer, h, attn):
        return ffn_inputs(layer, h, attn, mlp_form, experts_form)
    return network.ffn_inputs(layer, h, attn)


def norm_fp8_serves(x: torch.Tensor, norm: RMSNorm, scale: torch.Tensor) -> bool:
    """Whether the kernel takes rows x [rows, d] (bf16/fp16, contiguous, d at most `ROW_MAX_COLS`) with their
    norm (weights of x's dtype) and a one-value fp32 scale."""
    return (
        x.dtype in DTYPES
        and x.dim() == 2
        and x.is_contiguous()
        and x.shape[1] <= ROW_MAX_COLS
        and _row_weight(norm.weight, x.dtype, x.shape[1])
        and scale.dtype == torch.float32
        and scale.numel() == 1
    )


def norm_fp8(x: torch.Tensor, norm: RMSNorm, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of norm(x) / scale in one pass over each row (`norm_fp8_serves` must hold): a quantized
    linear's operand straight from the un-normed rows, the norm as torch's fused RMSNorm computes it but for
    the order of its sum of squares, rounded to x's dtype, then quantized as `kernels.quant.fp8` does."""
    import triton

    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if x.numel():
        _kernels().norm_fp8[(x.shape[0],)](
            x, norm.weight, scale, out, x.shape[1], norm.eps, E4M3_MAX=E4M3_MAX,
            BLOCK=triton.next_power_of_2(x.shape[1]), **ROW_OPTIONS,
        )  # fmt: skip
    return out


def norm_fp8_or_torch(x: torch.Tensor, norm: RMSNorm, scale: torch.Tensor) -> torch.Tensor:
    """`norm_fp8` where it serves (`norm_fp8_serves`), else the torch form: what the GPU loader installs."""
    return norm_fp8(x, norm, scale) if norm_fp8_serves(x, norm, scale) else sl.fp8_quantize(norm(x), scale)


def norm_nvfp4_serves(x: torch.Tensor, norm: RMSNorm, gs: torch.Tensor) -> bool:
    """`norm_fp8_serves`, with rows of whole 16-value blocks and a one-value fp32 global scale."""
    return norm_fp8_serves(x, norm, gs) and x.shape[1] % NVFP4_BLOCK == 0


def norm_nvfp4(
    x: torch.Tensor, norm: RMSNorm, gs: torch.Tensor, normed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of norm(x) under the global scale `gs` in one pass over each row (`norm_nvfp4_serves` must
    hold): (codes in pairs, uint8 [M, K/2]; block scales swizzled for a linear's FP4 GEMM, flat uint8), as
    `kernels.quant.nvfp4_blocked` makes them of the norm `norm_fp8` computes. `normed`: an [M, K] tensor of
    x's dtype that also receives the normed rows (the probe's check of what was quantized)."""
    import triton

    m, k = x.shape
    rows, cp = sl.blocked_shape(m, k // NVFP4_BLOCK)
    packed = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows * cp, dtype=torch.uint8, device=x.device)
    if rows:
        _kernels().norm_nvfp4[(rows,)](
            x, norm.weight, gs, packed, scales, x if normed is None else normed, m, k, cp, norm.eps,
            E2M1_MAX=E2M1_MAX, E4M3_MAX=E4M3_MAX, WRITE_NORMED=normed is not None,
            BLOCK=max(64, triton.next_power_of_2(k)), **ROW_OPTIONS,
        )  # fmt: skip
    return packed, scales


def norm_nvfp4_or_torch(
    x: torch.Tensor, norm: RMSNorm, gs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_nvfp4` where it serves (`norm_nvfp4_serves`), else the norm, then `kernels.quant.nvfp4_blocked`:
    what the GPU loader installs."""
    return norm_nvfp4(x, norm, gs) if norm_nvfp4_serves(x, norm, gs) else quant.nvfp4_blocked(norm(x), gs)


KV_CAT_VALUES = 4096  # values per program: 16 tokens of a 256-wide head, 8 of a 512-wide one
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kv_cat_serves(past_k: torch.Tensor, past_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes the cached K/V [B, H, P, D] and the new [B, H, Q, D]: one dtype, K and V laid
    out alike (the cache's two buffers, the projections' two outputs), each row of D contiguous."""
    tensors = (past_k, past_v, k, v)
    return (
        past_k.dtype in KV_DTYPES
        and all(t.dtype == past_k.dtype and t.dim() == 4 and t.stride(-1) == 1 for t in tensors)
        and past_k.shape == past_v.shape
        and k.shape == v.shape
        and past_k.stride() == past_v.stride()
        and k.stride() == v.stride()
        and past_k.shape[:2] == k.shape[:2]
        and past_k.shape[3] == k.shape[3]
    )


def kv_cat(
    past_k: torch.Tensor, past_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cat(past_k, k), cat(past_v, v)) along the tokens in one launch (`kv_cat_serves` must hold): what a
    pass over cached tokens reads where the cache has no room for its own (a prefill chunk, a commit), the
    cached context's K/V then the new tokens'. torch.cat is one launch per
    tensor, and on an H200 at 16 canvases its kernel moved the 26B's K/V at about 1 TB/s."""
    import triton

    b, heads, past, d = past_k.shape
    total = past + k.shape[2]
    out_k = torch.empty(b, heads, total, d, dtype=k.dtype, device=k.device)
    out_v = torch.empty_like(out_k)
    if out_k.numel():
        d_p2 = triton.next_power_of_2(d)
        block = max(1, KV_CAT_VALUES // d_p2)
        _kernels().kv_cat[(b * heads, triton.cdiv(total, block))](
            past_k, past_v, k, v, out_k, out_v, heads, past, total, *past_k.stride()[:3], *k.stride()[:3],
            D=d, D_P2=d_p2, BLOCK_T=block, **OPTIONS,
        )  # fmt: skip
    return out_k, out_v


def kv_cat_or_torch(
    past_k: torch.Tensor, past_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_cat` where it serves (`kv_cat_serves`), else torch.cat: what the GPU loader installs."""
    if kv_cat_serves(past_k, past_v, k, v):
        return kv_cat(past_k, past_v, k, v)
    return network.cat_kv(past_k, past_v, k, v)


SCALE_COLUMNS_BLOCK = 4096  # values per program


def scale_columns_serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes x [..., cols] times w [cols]: one dtype (bf16/fp16), both contiguous."""
    return x.dim() >= 1 and x.dtype in DTYPES and x.is_contiguous() and _row_weight(w, x.dtype, x.shape[-1])


def scale_columns(x: torch.Tensor, w: torch.Tensor, c: float) -> torch.Tensor:
    """x * w * c in one pass (`scale_columns_serves` must hold): the router's input, its normed residual
    times a learned per-column scale and a fixed number, rounded where torch's two kernels round (c in fp32,
    as torch's CUDA kernels take a Python number for a bf16 tensor)."""
    import triton

    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _kernels().scale_columns[(triton.cdiv(n, SCALE_COLUMNS_BLOCK),)](
            x, w, out, n, x.shape[-1], fp32(c), BLOCK=SCALE_COLUMNS_BLOCK, **OPTIONS
        )
    return out


def scale_columns_or_torch(x: torch.Tensor, w: torch.Tensor, c: float) -> torch.Tensor:
    """`scale_columns` where it serves (`scale_columns_serves`), else the torch form: what the GPU loader installs."""
    return scale_columns(x, w, c) if scale_columns_serves(x, w) else x * w * c
