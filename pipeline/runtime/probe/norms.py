"""The probes of the kernels built around RMSNorms (`kernels.chains`): a layer's end, its FFN inputs,
attention's head norms with RoPE, and a norm writing FP8 or NVFP4 operands; each held to torch's fused
RMSNorm within what summing squares in another order allows."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.config import TextConfig
from pipeline.model.fake_quant import NVFP4_BLOCK
from pipeline.model.network import (
    DecoderLayer,
    RMSNorm,
    Router,
    apply_rope,
    ffn_inputs,
    ffn_norms,
    layer_end,
    rotate_half,
)
from pipeline.runtime import kernels
from pipeline.runtime.probe.common import (
    TRITON_FALLBACK,
    fp8_codes_equal,
    same_bits,
    same_layer_end,
    spread,
    within,
)
from pipeline.runtime.tensor_cores import quantize_rows


def same_layer_end_of(
    got: torch.Tensor,
    residual: torch.Tensor,
    dense: torch.Tensor,
    moe: torch.Tensor,
    norms: tuple[RMSNorm, ...],
    scale: torch.Tensor,
) -> bool:
    """Whether `got` is a layer's end, `network.layer_end`: (residual + norm(norm_1(dense) + norm_2(moe))) *
    scale, as closely as norms summing their squares in another order let it be: within `same_layer_end` of
    torch's form, plus 2^-6 of what a rounding of norm_1(dense) or norm_2(moe) moves the result by through the
    outer norm (their magnitudes times its weight over the RMS of their sum, times the scale). Where the two
    cancel, their sum one rounding off is far off relatively, and the outer norm keeps that: at a pass's
    4,096 rows of the 26B's width some values do. A wrong weight, eps or order is off by far more."""
    want = layer_end(residual, dense, moe, norms, scale)
    n1, n2 = norms[0](dense), norms[1](moe)
    s = (n1 + n2).float()
    rms = (s.square().mean(-1, keepdim=True) + norms[2].eps).sqrt()
    outer_weight = 1.0 if norms[2].weight is None else norms[2].weight.float()
    inner = (n1.float().abs() + n2.float().abs()) * outer_weight / rms * scale.float().abs()
    outer = want.float().abs() + (residual.float() * scale.float()).abs()
    return within(got, want, 2.0**-6 * (outer + inner.nan_to_num(0.0, 0.0, 0.0)))


def check_triton_layer_end(dev: torch.device) -> None:
    """dgpipe's layer-end kernel (three RMSNorms, two sums, the scale) against torch's form
    (`network.layer_end`: torch's fused RMSNorm) at the 26B's width and one that is no power of two, bf16 and
    fp16, values over seven decades, a row of zeros and one with infinity and NaN: as close as a norm's sum in
    another order allows (`same_layer_end_of`), or a DgpipeError."""
    g = torch.Generator().manual_seed(12)
    for dtype, d in ((torch.bfloat16, 2816), (torch.float16, 2816), (torch.bfloat16, 100)):
        residual, dense, moe = (spread(9, d, g) / 64).to(dev, dtype).chunk(3)  # three rows of three
        dense[0], moe[1, :2] = 0.0, torch.tensor([float("inf"), float("nan")])
        norms = tuple(RMSNorm(d, 1e-6).to(dev, dtype) for _ in range(3))
        for n in norms:
            n.weight.data = (torch.rand(d, generator=g) * 2).to(dev, dtype)
        scale = torch.tensor([0.7], device=dev, dtype=dtype)
        got = kernels.chains.layer_end(residual, dense, moe, norms, scale)
        if not same_layer_end_of(got, residual, dense, moe, norms, scale):
            raise DgpipeError(
                f"the Triton layer end differs from torch's ({dtype}, {d} wide)", TRITON_FALLBACK
            )


def ffn_probe_layer(d: int, dev: torch.device, dtype: torch.dtype, g: torch.Generator) -> SimpleNamespace:
    """What `network.ffn_inputs` reads of a decoder layer, `d` wide with random norm weights and router
    scales: its post-attention and two pre-FFN norms and its router."""
    norms = [RMSNorm(d, 1e-6).to(dev, dtype) for _ in range(3)]
    router = Router(TextConfig(hidden_size=d, num_experts=8, top_k_experts=2)).to(dev, dtype)
    for w in (*(n.weight for n in norms), router.scale):
        w.data = (torch.rand(d, generator=g) * 2).to(dev, dtype)
    return SimpleNamespace(post_attention_layernorm=norms[0], pre_feedforward_layernorm=norms[1],
                           pre_feedforward_layernorm_2=norms[2], router=router)  # fmt: skip


def check_triton_ffn_inputs(dev: torch.device) -> None:
    """dgpipe's FFN-inputs kernel (a norm, the residual sum, three norms of it, the router's scales) against
    torch's form (`network.ffn_inputs`) at the 26B's width and one that is no power of two, bf16 and fp16,
    values over seven decades, a zero row and one with infinity and NaN: each output as close as a norm's sum
    in another order allows (`same_ffn_inputs`); and the launches that write the MLP's and the experts'
    inputs as FP8 or NVFP4 operands (`same_operands`) write what the torch forms of the quantizations make of
    the rows it writes otherwise, bit for bit, and their other outputs unchanged; or a DgpipeError. Each
    operand form is checked on rows in an order of its own: on a GPU the caching allocator hands a launch
    the blocks an earlier one freed, and a launch that never wrote its residual would pass on a block that
    holds the same rows' residual already."""
    g = torch.Generator().manual_seed(13)
    orders = {
        "fp8": lambda t: t.roll(1, 0),
        "nvfp4": lambda t: t.roll(2, 0),
        "fp8_rowwise": lambda t: t.flip(0),
    }
    for dtype, d in ((torch.bfloat16, 2816), (torch.float16, 2816), (torch.bfloat16, 100)):
        h, attn = (spread(6, d, g) / 64).to(dev, dtype).view(2, 3, d).unbind()
        attn[0], h[1, :2] = 0.0, torch.tensor([float("inf"), float("nan")])
        layer = ffn_probe_layer(d, dev, dtype, g)
        got = kernels.chains.ffn_inputs(layer, h, attn)
        if not (
            same_ffn_inputs(got, layer, h, attn)
            and all(same_operands(layer, order(h), order(attn), None, kind) for kind, order in orders.items())
            and same_operands(layer, *(t.repeat(43, 1)[:128] for t in (h, attn)), None, "nvfp4")  # swizzled
        ):
            raise DgpipeError(
                f"the Triton FFN inputs differ from torch's ({dtype}, {d} wide)", TRITON_FALLBACK
            )


def same_ffn_inputs(got: tuple, layer: DecoderLayer, h: torch.Tensor, attn: torch.Tensor) -> bool:
    """Whether a layer's four FFN inputs (`network.ffn_inputs`: the residual, the MLP's, the experts' and the
    router's inputs) agree with torch's form as closely as norms summing their squares in another order let
    them: the residual within `same_layer_end` of torch's (h its residual term), and the three norms of it
    within `same_layer_end` of torch's norms of that same residual (`network.ffn_norms`). Where h and the
    normed attention output cancel, a residual value one rounding off is far off relatively, and a norm of
    it keeps that: at a pass's 4,096 rows some values do. A wrong weight, eps or input is off by far more."""
    one = torch.ones(1, device=h.device, dtype=h.dtype)
    return same_layer_end(got[0], ffn_inputs(layer, h, attn)[0], h, one) and all(
        same_layer_end(a, b, torch.zeros_like(b), one)
        for a, b in zip(got[1:], ffn_norms(layer, got[0])[1:], strict=True)
    )


def same_operands(
    layer: DecoderLayer, h: torch.Tensor, attn: torch.Tensor, rows: tuple | None, kind: str
) -> bool:
    """Whether `kernels.chains.ffn_inputs` writes the MLP's and the experts' inputs as `kind` operands
    (FP8 scales that saturate some codes; an NVFP4 global scale, for NVFP4 or the Hopper/Ada fallback's per-row
    FP8 of NVFP4-rounded rows) bit for bit as the torch forms quantize
    the rows it writes otherwise (`rows`: that launch's outputs, or None to launch it here), in the layouts
    their consumers' own quantization gives: for the MLP's linear `ScaledLinear.quantize`'s (NVFP4 block
    scales swizzled, where the rows fill whole 128-row tiles, else the rows themselves), for the experts
    `tensor_cores.quantize_rows`' (NVFP4 forms of rows of no whole 16-value blocks: the rows themselves);
    its residual and router input unchanged."""
    rows = rows or kernels.chains.ffn_inputs(layer, h, attn)
    dev, n = h.device, rows[2].shape[0]
    mlp_scale, experts_scale = (
        torch.tensor(s, device=dev) for s in ((0.002, 0.0005) if kind == "fp8" else (0.003, 0.004))
    )
    got = kernels.chains.ffn_inputs(layer, h, attn, (kind, mlp_scale), (kind, experts_scale))
    if not (same_bits(got[0], rows[0]) and same_bits(got[3], rows[3])):
        return False
    mlp, experts = got[1], got[2]
    if kind != "fp8" and rows[2].shape[-1] % NVFP4_BLOCK:  # no whole blocks: the rows, which GEMMs quantize
        return all(
            not isinstance(q, sl.QuantizedRows) and same_bits(q, r)
            for q, r in ((mlp, rows[1]), (experts, rows[2]))
        )
    if kind == "fp8":
        return (
            isinstance(mlp, sl.QuantizedRows)
            and mlp.scales[0] is mlp_scale
            and fp8_codes_equal(mlp.operand, sl.fp8_quantize(rows[1], mlp_scale))
            and isinstance(experts, sl.QuantizedRows)
            and torch.equal(experts.scales[0], experts_scale.float().expand(n))
            and fp8_codes_equal(experts.operand, sl.fp8_quantize(rows[2], experts_scale))
        )
    if kind == "fp8_rowwise":  # E4M3 of the NVFP4-rounded rows, a scale each: [n, 1] for the linear, [n]
        wants = (
            quantize_rows(r.reshape(n, -1), s, kind)
            for r, s in ((rows[1], mlp_scale), (rows[2], experts_scale))
        )
        return all(
            isinstance(q, sl.QuantizedRows)
            and fp8_codes_equal(q.operand.reshape(n, -1), want_q)
            and torch.equal(q.scales[0], want_s[:, None] if q is mlp else want_s)
            for q, (want_q, want_s) in zip((mlp, experts), wants, strict=True)
        )
    codes, bs = sl.nvfp4_quantize(rows[2], experts_scale)
    if not (
        isinstance(experts, sl.QuantizedRows)
        and torch.equal(experts.operand, codes)
        and fp8_codes_equal(experts.scales[0], bs)
    ):
        return False
    if n % sl.TILE_ROWS:  # no whole tiles: the rows, which the linear quantizes itself
        return not isinstance(mlp, sl.QuantizedRows) and same_bits(mlp, rows[1])
    codes, bs = sl.nvfp4_quantize(rows[1].reshape(n, -1), mlp_scale)
    return (
        isinstance(mlp, sl.QuantizedRows)
        and torch.equal(mlp.operand.reshape(n, -1), codes)
        and torch.equal(
            mlp.scales[0].view(torch.uint8).flatten(), sl.to_blocked(bs.view(torch.uint8)).flatten()
        )
        and mlp.scales[1] is mlp_scale
    )


def same_rotation(
    got: torch.Tensor, want: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    """Whether two rotations of normed heads agree as closely as norms summing their squares in another
    order let them: each value within 2^-5 of |normed * cos| + |rotate_half(normed) * sin| (a normed value a
    unit of 2^-7 off, carried through the two products and their sum, where the two can cancel), NaN where
    the other has NaN. A wrong weight, eps, angle or half is off by far more."""
    g, w = got.float(), want.float()
    n, c, s = normed.float(), cos.float()[:, :, None, :], sin.float()[:, :, None, :]
    bound = 2.0**-5 * ((n * c).abs() + (rotate_half(n) * s).abs())
    close = ((g - w).abs() <= bound) | (g == w)
    return bool(torch.equal(g.isnan(), w.isnan()) and (close | w.isnan()).all())


def check_triton_head_norms(dev: torch.device) -> None:
    """dgpipe's head-norms kernel (q's or k's norm and RoPE, v's norm) against torch's form (torch's fused
    RMSNorm, `network.apply_rope`) at the 26B's head dims (256, 512) in bf16 and 256 in fp16, two batch rows
    of 7 tokens at positions of their own up to 2^17, rows over seven decades, a zero row and one with
    infinity and NaN, the heads contiguous or columns of one merged q|k|v projection (256-wide heads):
    within `same_rotation`, v's within
    `same_layer_end` of its value, or a DgpipeError. And q (another head count, its own weight) in k's and
    v's launch: each of the three bit for bit what its own launch gives, q's also written head-major, and k's
    and v's also into a cache's room."""
    g = torch.Generator().manual_seed(16)
    for dtype, d in ((torch.bfloat16, 256), (torch.bfloat16, 512), (torch.float16, 256)):
        if d == 256:  # x and v 3 heads each of one token's 8 (q|k|v's columns), tokens 8 heads apart
            proj = (spread(2 * 7 * 8, d, g) / 64).to(dev, dtype).view(2, 7, 8 * d)
            x, v = proj[..., : 3 * d].view(2, 7, 3, d), proj[..., 5 * d :].view(2, 7, 3, d)
        else:
            x, v = (spread(2 * 2 * 7 * 3, d, g) / 64).to(dev, dtype).view(4, 7, 3, d).chunk(2)
        x[0, 0, 0], v[0, 1, 2, :2] = 0.0, torch.tensor([float("inf"), float("nan")])
        norm, v_norm = RMSNorm(d, 1e-6).to(dev, dtype), RMSNorm(d, 1e-6, with_scale=False)
        norm.weight.data = (torch.rand(d, generator=g) * 2).to(dev, dtype)
        angles = torch.randint(0, 2**17, (2, 7, 1), generator=g).float() * torch.logspace(0, -4, d // 2)
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().to(dev, dtype), emb.sin().to(dev, dtype)
        got, got_v, _ = kernels.chains.head_norms(x, norm, cos, sin, v, v_norm)
        normed = norm(x)
        zero, one = torch.zeros_like(v), torch.ones(1, device=dev, dtype=dtype)
        if not same_rotation(got, apply_rope(normed, cos, sin), normed, cos, sin) or not same_layer_end(
            got_v, v_norm(v), zero, one
        ):
            raise DgpipeError(
                f"the Triton head norms differ from torch's ({dtype}, head dim {d})", TRITON_FALLBACK
            )
        q, q_norm = _probe_q(proj if d == 256 else None, d, dtype, dev, g)
        alone_q = kernels.chains.head_norms(q, q_norm, cos, sin)[0]
        q_normed = q_norm(q)
        together = kernels.chains.head_norms(x, norm, cos, sin, v, v_norm, q, q_norm)
        head_major = kernels.chains.head_norms(x, norm, cos, sin, v, v_norm, q, q_norm, q_head_major=True)[2]
        if (
            not same_rotation(alone_q, apply_rope(q_normed, cos, sin), q_normed, cos, sin)
            or not all(same_bits(a, b) for a, b in zip(together, (got, got_v, alone_q), strict=True))
            or not (head_major.is_contiguous() and same_bits(head_major.transpose(1, 2), alone_q))
            or not _into_room(x, norm, cos, sin, v, v_norm, q, q_norm, (got, got_v, alone_q))
        ):
            raise DgpipeError(
                f"the Triton head norms of q, k and v in one launch differ from their own ({dtype}, head dim {d})",
                TRITON_FALLBACK,
            )


def _into_room(x, norm, cos, sin, v, v_norm, q, q_norm, want: tuple[torch.Tensor, ...]) -> bool:
    """Whether the three-part launch writes k's and v's heads into a cache's room (views [B, H, L, D] of its K
    and V buffers, a row and some tokens into them) as their own launch writes them, q as its own launch,
    and leaves the rest of the buffers as they were."""
    b, seq, heads, d = x.shape
    cache = torch.full((2, b + 1, heads, seq + 5, d), 3.0, device=x.device, dtype=x.dtype)  # K|V buffers
    room = cache[0, 1:, :, 2 : 2 + seq], cache[1, 1:, :, 2 : 2 + seq]
    k, v_out, q_out = kernels.chains.head_norms(x, norm, cos, sin, v, v_norm, q, q_norm, out=room)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[:, 1:, :, 2 : 2 + seq] = False
    return (
        k is room[0]
        and v_out is room[1]
        and same_bits(room[0], want[0].transpose(1, 2))
        and same_bits(room[1], want[1].transpose(1, 2))
        and same_bits(q_out, want[2])
        and bool((cache[untouched] == 3.0).all())
    )


def _probe_q(
    proj: torch.Tensor | None, d: int, dtype: torch.dtype, dev: torch.device, g: torch.Generator
) -> tuple[torch.Tensor, RMSNorm]:
    """q heads for the head-norms probe beside its x and v: two heads of the merged projection's columns
    between them (`proj`), or five heads of their own; with a norm weight of q's own."""
    if proj is not None:
        q = proj[..., 3 * d : 5 * d].view(2, 7, 2, d)
    else:
        q = (spread(2 * 7 * 5, d, g) / 64).to(dev, dtype).view(2, 7, 5, d)
    q_norm = RMSNorm(d, 1e-6).to(dev, dtype)
    q_norm.weight.data = (torch.rand(d, generator=g) * 2).to(dev, dtype)
    return q, q_norm


def same_fp8_of_norm(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two E4M3 quantizations of normed rows agree as closely as norms summing their squares in
    another order let them: each value within one E4M3 step (2^-3 of it, or of the smallest subnormal 2^-9:
    a normed value one bf16 rounding off can cross a rounding boundary of the codes), NaN where the other has
    NaN. A wrong weight, scale or eps is off by far more."""
    g, w = got.float(), want.float()
    close = ((g - w).abs() <= 2.0**-3 * w.abs() + 2.0**-9) | (g == w)
    return bool(torch.equal(g.isnan(), w.isnan()) and (close | w.isnan()).all())


def rows_to_norm(
    n: int, d: int, dev: torch.device, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, RMSNorm]:
    """The norm probes' input: rows [n, d] over seven decades with a zero row and one with infinity and NaN,
    and an RMSNorm with random weights in [0, 2)."""
    x = (spread(n, d, g) / 64).to(dev, dtype)
    x[0], x[1, :2] = 0.0, torch.tensor([float("inf"), float("nan")])
    norm = RMSNorm(d, 1e-6).to(dev, dtype)
    norm.weight.data = (torch.rand(d, generator=g) * 2).to(dev, dtype)
    return x, norm


def check_triton_norm_fp8(dev: torch.device) -> None:
    """dgpipe's norm-to-FP8 kernel against torch's fused RMSNorm then the FP8 quantization, at the 26B's width
    and one that is no power of two, bf16 and fp16, rows over seven decades (some past E4M3's range after
    the scale), a zero row and one with infinity and NaN: within `same_fp8_of_norm`, or a DgpipeError."""
    g = torch.Generator().manual_seed(17)
    for dtype, d in ((torch.bfloat16, 2816), (torch.float16, 2816), (torch.bfloat16, 100)):
        x, norm = rows_to_norm(6, d, dev, dtype, g)
        scale = torch.tensor(0.004, device=dev)
        if not same_fp8_of_norm(kernels.chains.norm_fp8(x, norm, scale), sl.fp8_quantize(norm(x), scale)):
            raise DgpipeError(
                f"the Triton norm to FP8 differs from torch's ({dtype}, {d} wide)", TRITON_FALLBACK
            )


def check_triton_norm_nvfp4(dev: torch.device) -> None:
    """dgpipe's norm-to-NVFP4 kernel: the rows it normed within a norm's rounding of torch's fused RMSNorm
    (`same_layer_end`), their NVFP4 codes and swizzled block scales bit for bit what
    `scaled_layout.nvfp4_quantize` and `to_blocked` make of them (33 rows: padded to a 128-row tile), and the
    same bytes from the launch that does not write the normed rows (the one a pass runs); bf16 and fp16 at
    the 26B's width and a narrow one, rows over seven decades, a zero row and one with infinity and NaN, or
    a DgpipeError."""
    g = torch.Generator().manual_seed(18)
    for dtype, d in ((torch.bfloat16, 2816), (torch.float16, 2816), (torch.bfloat16, 96)):
        x, norm = rows_to_norm(33, d, dev, dtype, g)
        # NaN until the kernel writes it: an empty buffer may hold an earlier probe's correct rows
        gs, normed = torch.tensor(0.003, device=dev), torch.full_like(x, float("nan"))
        (q, s), (q_pass, s_pass) = (kernels.chains.norm_nvfp4(x, norm, gs, out) for out in (normed, None))
        want_q, want_s = sl.nvfp4_quantize(normed, gs)
        swizzled = sl.to_blocked(want_s.view(torch.uint8)).flatten()
        zero, one = torch.zeros_like(x), torch.ones(1, device=dev, dtype=dtype)
        if not (
            same_layer_end(normed, norm(x), zero, one)
            and torch.equal(q, want_q)
            and torch.equal(s.flatten(), swizzled)
            and torch.equal(q_pass, q)
            and torch.equal(s_pass, s)
        ):
            raise DgpipeError(
                f"the Triton norm to NVFP4 differs from torch's ({dtype}, {d} wide)", TRITON_FALLBACK
            )
