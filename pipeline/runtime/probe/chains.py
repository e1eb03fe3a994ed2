"""The probes of the network's element-wise one-kernel chains (`kernels.chains`): RoPE, the logit
softcap, the MoE combine, the gated GeLU, the residual sum, the K/V concatenation and the router's input,
each against the torch form it replaces."""

from __future__ import annotations

import torch

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.network import (
    apply_rope,
    cat_kv,
    combine_slots,
    gelu_tanh,
)
from pipeline.runtime import kernels
from pipeline.runtime.probe.common import (
    FLOATS,
    HALF_FLOATS,
    TRITON_FALLBACK,
    fp8_codes_equal,
    rel_l2,
    same_bits,
    spread,
)


def check_triton_rope(dev: torch.device) -> None:
    """dgpipe's RoPE kernel bit for bit against the torch form (`network.apply_rope`) at the 26B's head dims
    in bf16 (256, 512) and one in fp16 (each its own compile), over positions up to 2^17, or a DgpipeError."""
    g = torch.Generator().manual_seed(4)
    for dtype, d in ((torch.bfloat16, 256), (torch.bfloat16, 512), (torch.float16, 256)):
        x = (torch.randn(2, 7, 3, d, generator=g) * 4).to(dev, dtype)
        positions = torch.randint(0, 2**17, (2, 7, 1), generator=g).float()
        angles = positions * torch.logspace(0, -4, d // 2)
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().to(dev, dtype), emb.sin().to(dev, dtype)
        if not torch.equal(kernels.chains.rope(x, cos, sin), apply_rope(x, cos, sin)):
            raise DgpipeError(f"the Triton RoPE kernel differs from torch's ({dtype}, head dim {d})",
                              "dgpipe keeps torch's element-wise RoPE; report the GPU, torch and Triton versions")  # fmt: skip


def check_triton_softcap(dev: torch.device) -> None:
    """dgpipe's softcap kernel against torch's form on logits from 0 to 1e4, infinities and NaN, in each of
    `FLOATS` (the LM head writes the model's dtype), or a DgpipeError: within 1e-6 relative, a few fp32 units
    in the last place (the kernel computes torch's CUDA arithmetic; a tanh of another libdevice or libm build
    may differ by an ulp or two; a wrong kernel is O(1))."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 1000, generator=g) * torch.logspace(-3, 4, 64)[:, None]
    logits[0, :4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
    for dtype in FLOATS:
        x = logits.to(dev, dtype)
        got, want = kernels.chains.softcap(x, 30.0), x.float().div_(30.0).tanh_().mul_(30.0)
        if not torch.allclose(got, want, rtol=1e-6, atol=0.0, equal_nan=True):
            raise DgpipeError(f"the Triton logit softcap differs from torch's by up to {float((got - want).abs().nan_to_num().max()):.3g} ({dtype})",
                              "dgpipe keeps torch's element-wise softcap; report the GPU, torch and Triton versions")  # fmt: skip


def check_triton_combine(dev: torch.device) -> None:
    """dgpipe's MoE combine kernel bit for bit against its torch form (`kernels.chains.sequential_combine`),
    rows gathered through the expert order's inverse and in slot order, and within bf16 rounding of the
    batched product it replaces (`network.combine_slots`), on bf16 and fp16 expert outputs (an fp16 model's
    float experts write fp16), or a DgpipeError."""
    g = torch.Generator().manual_seed(6)
    index, weights = torch.randint(0, 16, (37, 8), generator=g), torch.rand(37, 8, generator=g)
    rows = sl.slot_rows(sl.expert_order(index, 16))
    outputs = torch.randn(37 * 8, 2816 + 8, generator=g) * 4  # a row not a block multiple
    rows, weights = rows.to(dev), weights.to(dev)
    for dtype in HALF_FLOATS:
        y = outputs.to(dev, dtype)
        for r in (rows, None):
            got = kernels.chains.combine(y, r, weights)
            if not torch.equal(got, kernels.chains.sequential_combine(y, r, weights)):
                raise DgpipeError(
                    f"the Triton MoE combine differs from its torch form ({dtype})", TRITON_FALLBACK
                )
        err = rel_l2(got, combine_slots(y, weights).float())
        if not err < 1e-2:  # bf16 rounding apart; a wrong kernel is O(1)
            raise DgpipeError(f"the Triton MoE combine differs from the batched product by {err:.3g} (relative L2, "
                              f"{dtype})", TRITON_FALLBACK)  # fmt: skip


def same_geglu(got: torch.Tensor, want: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether two gated GeLUs of gate and up agree as closely as two tanh implementations let them: within
    2^-6 of the value (its two roundings to bf16, each up to a unit of 2^-7 apart) plus 2.4e-7 |gate * up| (a
    tanh two fp32 ulps off near -1, which `1 + tanh` turns into the whole result in the negative tail),
    infinities and NaN in the same places. A wrong kernel is O(1) off."""
    a, b = got.float(), want.float()
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    a, b, scale = a[~nan], b[~nan], (gate.float() * up.float())[~nan].abs()
    inf = a.isinf() | b.isinf()
    if not torch.equal(a[inf], b[inf]):
        return False
    return bool(((a - b).abs() <= b.abs() * 2**-6 + scale * 2.4e-7)[~inf].all())


def check_triton_geglu(dev: torch.device) -> None:
    """dgpipe's gated-GeLU kernel against torch's form (`gelu_tanh(gate) * up`) on the gate|up halves of one
    GEMM output, 704 and 2,112 wide (the 26B's experts and dense MLP), values over seven decades with zeros,
    infinities and NaN, in bf16 and fp16: as close as another tanh allows (`same_geglu`; bit for bit where
    its tanh, libdevice's, is the one torch's kernel was built with); and its FP8 and NVFP4 codes those of
    its own product quantized (`scaled_layout.fp8_quantize`, `nvfp4_quantize`), bit for bit. Or a
    DgpipeError."""
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor(0.05, device=dev)
    for dtype, cols in ((torch.bfloat16, 704), (torch.bfloat16, 2112), (torch.float16, 704)):
        gu = spread(33, 2 * cols, g)
        gu[0, :4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
        gate, up = gu.to(dev, dtype).chunk(2, dim=-1)
        got = kernels.chains.geglu(gate, up)
        if not same_geglu(got, gelu_tanh(gate) * up, gate, up):
            raise DgpipeError(
                f"the Triton gated GeLU differs from torch's ({dtype}, {cols} wide)", TRITON_FALLBACK
            )
        if not fp8_codes_equal(kernels.chains.geglu(gate, up, scale), sl.fp8_quantize(got, scale)):
            raise DgpipeError(f"the Triton gated GeLU's FP8 codes differ from its product's ({dtype})",
                              TRITON_FALLBACK)  # fmt: skip
        if not same_nvfp4_of(got, gate, up, scale):
            raise DgpipeError(f"the Triton gated GeLU's NVFP4 codes differ from its product's ({dtype})",
                              TRITON_FALLBACK)  # fmt: skip


def same_nvfp4_of(product: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gs: torch.Tensor) -> bool:
    """`kernels.chains.geglu_nvfp4` of gate and up writes the NVFP4 codes and block scales of `product` (the
    kernel's own product), as they are and swizzled for a linear (33 rows: padded to a 128-row tile)."""
    want_q, want_s = sl.nvfp4_quantize(product, gs)
    (q, s), (qb, sb) = (kernels.chains.geglu_nvfp4(gate, up, gs, blocked) for blocked in (False, True))
    swizzled = sl.to_blocked(want_s.view(torch.uint8))
    return (
        torch.equal(q, want_q)
        and fp8_codes_equal(s, want_s)
        and torch.equal(qb, want_q)
        and fp8_codes_equal(sb, swizzled)
    )


def check_triton_residual(dev: torch.device) -> None:
    """dgpipe's residual-and-scale kernel bit for bit against torch's `(a + b) * scale` in bf16 and fp16, with
    sums that round, overflow and cancel, infinities and NaN, or a DgpipeError."""
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.bfloat16, torch.float16):
        a, b = spread(2, 4099, g).unbind()
        a[:5], b[:5] = (
            torch.tensor([6e4, 1.0, float("inf"), float("nan"), 3.0]),
            torch.tensor([6e4, -1.0, 1.0, 1.0, -3.0]),
        )
        a, b = a.to(dev, dtype), b.to(dev, dtype)
        scale = torch.tensor([0.7], device=dev, dtype=dtype)
        got, want = kernels.chains.add_scaled(a, b, scale), (a + b) * scale
        if not same_bits(got, want):
            raise DgpipeError(f"the Triton residual sum differs from torch's ({dtype})", TRITON_FALLBACK)


def check_triton_kv_cat(dev: torch.device) -> None:
    """dgpipe's K/V concatenation bit for bit against torch.cat, or a DgpipeError: the cached K/V read as the
    cache hands them out (the first tokens of some rows of its buffers: views) and the new K/V as attention
    makes them (transposed from [B, Q, H, D]), at head dims 256 and 512, with an empty cache, in bf16, fp16
    and fp32, a model's dtypes (`network.cat_kv`)."""
    g = torch.Generator().manual_seed(10)
    for dtype, heads, d, past in (
        (torch.bfloat16, 8, 256, 37),
        (torch.bfloat16, 2, 512, 0),
        (torch.bfloat16, 2, 512, 21),
        (torch.float16, 8, 256, 37),
        (torch.float32, 3, 24, 5),
    ):
        cache = torch.randn(2, 3, heads, 64, d, generator=g).to(dev, dtype)  # K|V, slots, heads, length, dim
        pk, pv = cache[0, 1:, :, :past], cache[1, 1:, :, :past]
        new = torch.randn(2, 2, 19, heads, d, generator=g).to(dev, dtype).transpose(2, 3)  # K|V, B, H, Q, D
        got = kernels.chains.kv_cat(pk, pv, new[0], new[1])
        want = cat_kv(pk, pv, new[0], new[1])
        if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            raise DgpipeError(f"the Triton K/V concatenation differs from torch.cat ({dtype}, head dim {d})",
                              TRITON_FALLBACK)  # fmt: skip


def check_triton_router(dev: torch.device) -> None:
    """dgpipe's router-input kernel bit for bit against torch's `x * scale * d^-0.5` (bf16 and fp16, the
    26B's width and one that is no block multiple, values over seven decades, infinities and NaN), or a
    DgpipeError."""
    g = torch.Generator().manual_seed(11)
    for dtype, d in ((torch.bfloat16, 2816), (torch.float16, 2816), (torch.bfloat16, 100)):
        x = spread(7, d, g)
        x[0, :3] = torch.tensor([float("inf"), float("nan"), 0.0])
        x, w, root = x.to(dev, dtype), (torch.rand(d, generator=g) * 4).to(dev, dtype), d**-0.5
        if not same_bits(kernels.chains.scale_columns(x, w, root), x * w * root):
            raise DgpipeError(
                f"the Triton router input differs from torch's ({dtype}, {d} wide)", TRITON_FALLBACK
            )
