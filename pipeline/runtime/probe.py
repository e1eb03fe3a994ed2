"""Which of the dispatch table's kernels this GPU and torch build run: each GEMM form the table names for
the GPU's architecture runs once on tiny operands at load (`probe`), and dgpipe's own Triton kernels must
also agree with a float reference that needs no vendor kernel (`check_triton_fp8`, `check_triton_float`), and
the network's one-kernel chains with their torch forms (`check_triton_rope`, `_softcap`, `_combine`,
`_geglu`, `_residual`, `_kv_cat`, `_router`, `_layer_end`, `_ffn_inputs`, `_top_k`, `_expert_order`, `_head_norms`, `_norm_fp8`, `_norm_nvfp4`),
and FP8 siblings merged into one RowWise GEMM with the linears alone (`check_fp8_columns`).
What fails takes the row's fallback (`pipeline.runtime.gpu_load`), so a kernel that a host's driver,
torch or Triton build cannot run costs speed, never a wrong answer or a crash while serving."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from pipeline.errors import DgpipeError, error_line
from pipeline.model import scaled_layout as sl
from pipeline.model.config import TextConfig
from pipeline.model.fake_quant import E4M3_MAX, NVFP4_BLOCK
from pipeline.model.modelopt import PackedLinear
from pipeline.model.network import (
    DecoderLayer,
    RMSNorm,
    Router,
    apply_rope,
    cat_kv,
    combine_slots,
    combine_top_k,
    ffn_inputs,
    ffn_norms,
    gelu_tanh,
    layer_end,
    rotate_half,
    route_scores,
)
from pipeline.runtime import kernels
from pipeline.runtime.dispatch import EVERY_PASS, arch_of, dispatch
from pipeline.runtime.routed import routed_experts
from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear, kernel_mode, quantize_rows


@dataclass
class Probe:
    """What this GPU and torch build run: kernel name -> None (ran) or the error it raised."""

    arch: str | None
    results: dict[str, str | None] = field(default_factory=dict)

    def ok(self, kernel: str) -> bool:
        return kernel in self.results and self.results[kernel] is None


def _tiny_packed(fmt: str, n: int = 128, k: int = 128, seed: int = 0) -> PackedLinear:
    """A random quantized linear in ModelOpt's stored layout, for probing."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if fmt == "fp8":
        s = w.abs().amax() / E4M3_MAX
        return PackedLinear("FP8", sl.fp8_quantize(w, s), s, None, torch.tensor(0.01))
    gs = w.abs().amax() / (6 * E4M3_MAX)
    packed, bs = sl.nvfp4_quantize(w, gs)
    return PackedLinear("NVFP4", packed, bs, gs, torch.tensor(0.01))


PROBED_FORMATS = ("fp8", "nvfp4", "bf16", "int4_awq")
# Triton compiles a kernel anew for each dtype of its tensors, so a kernel is probed in every dtype a load can
# hand it: the float dtypes a model loads in, for kernels that take any float input (the LM head's logits,
# the activations the one-pass quantizations read); bf16 and fp16 for those whose `*_serves` admits those
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
HALF_FLOATS = (torch.bfloat16, torch.float16)
# `kernels.chains`'s kernels, probed on every GPU whatever the checkpoint's format
ROPE_FORM = ("rope", "bf16", "bf16")  # checked in bf16 and fp16
SOFTCAP_FORM = ("softcap", "bf16", "bf16")  # bf16 logits in, fp32 out
COMBINE_FORM = ("combine", "bf16", "bf16")  # the experts' bf16 outputs
GEGLU_FORM = ("geglu", "bf16", "bf16")  # checked in bf16 and fp16, and with its FP8 quantization
RESIDUAL_FORM = ("residual", "bf16", "bf16")  # checked in bf16 and fp16
KV_CAT_FORM = ("kv_cat", "bf16", "bf16")  # checked in bf16 and fp32
ROUTER_FORM = ("router", "bf16", "bf16")  # checked in bf16 and fp16
LAYER_END_FORM = ("layer_end", "bf16", "bf16")  # checked in bf16 and fp16
FFN_INPUTS_FORM = ("ffn_inputs", "bf16", "bf16")  # checked in bf16 and fp16
TOP_K_FORM = ("top_k", "bf16", "bf16")  # the router's bf16 scores, and fp32 ones
EXPERT_ORDER_FORM = ("expert_order", "bf16", "bf16")  # int64 experts whatever the model's dtype
HEAD_NORMS_FORM = ("head_norms", "bf16", "bf16")  # checked in bf16 and fp16
NORM_FP8_FORM = ("norm_fp8", "bf16", "bf16")  # bf16 and fp16 rows to E4M3
NORM_NVFP4_FORM = ("norm_nvfp4", "bf16", "bf16")  # bf16 and fp16 rows to NVFP4, scales swizzled
NETWORK_FORMS = (ROPE_FORM, SOFTCAP_FORM, COMBINE_FORM, GEGLU_FORM, RESIDUAL_FORM, KV_CAT_FORM, ROUTER_FORM,
                 LAYER_END_FORM, FFN_INPUTS_FORM, TOP_K_FORM, EXPERT_ORDER_FORM, HEAD_NORMS_FORM,
                 NORM_FP8_FORM, NORM_NVFP4_FORM)  # fmt: skip
(ROPE, SOFTCAP, COMBINE, GEGLU, RESIDUAL, KV_CAT, ROUTER, LAYER_END, FFN_INPUTS, TOP_K, EXPERT_ORDER,
 HEAD_NORMS, NORM_FP8, NORM_NVFP4) = (f"{kind}:{mode}" for kind, mode, _ in NETWORK_FORMS)  # fmt: skip
# the modes whose activations `kernels.quant`'s one-pass kernels quantize, each probed on its own ("quant")
ONE_PASS_MODES = ("fp8", "nvfp4", "fp8_rowwise")
# FP8 linears that read one input, each with its own weight scale, as one RowWise GEMM (`shared_input`):
# probed for every row whose linears are FP8
FP8_COLUMNS_FORM = ("siblings", "fp8_columns", "fp8")
FP8_COLUMNS = ":".join(FP8_COLUMNS_FORM[:2])


def probe_plan(arch: str | None, formats: tuple[str, ...] = PROBED_FORMATS) -> list[tuple[str, str, str]]:
    """The (kind, mode, weight format) forms `probe` runs on `arch` for checkpoints in `formats`: only those
    the dispatch table names for it. A kernel built for another architecture can do worse than raise: on an
    H200 the NVFP4 grouped GEMM failed to set up its TMA descriptors and left a sticky "unspecified launch
    failure" that broke every later CUDA call in the process."""
    if arch is None:
        return []
    plan: list[tuple[str, str, str]] = []
    for fmt in formats:
        row = dispatch(fmt, arch)
        uses = (("linear", row.linears, True), ("experts", row.experts, row.torch_experts),
                ("triton", row.experts, row.triton), ("triton", row.experts_fallback or "", bool(row.experts_fallback)))  # fmt: skip
        for kind, kernel, used in uses:
            mode = kernel_mode(kernel) if used else None
            # activations' one-pass quantization is a kernel of its own, whichever GEMM reads them
            for k in (kind, "quant") if mode in ONE_PASS_MODES else (kind,):
                form = (k, mode, {"fp8": "fp8", "bf16": "bf16"}.get(mode or "", "nvfp4"))
                if mode and form not in plan:
                    plan.append(form)
        if kernel_mode(row.linears) == "fp8" and FP8_COLUMNS_FORM not in plan:
            plan.append(FP8_COLUMNS_FORM)
    return [*plan, *NETWORK_FORMS]


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


def fp8_codes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two E4M3 tensors hold the same codes, NaN's sign aside (torch keeps the input's, the hardware
    conversion writes the canonical 0x7F; a NaN activation is NaN downstream either way)."""
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


def float_gemm(a, a_scale, rows, w, w_scale, offs) -> torch.Tensor:
    """`kernels.moe.moe_gemm` in fp32 expert by expert (it reads the end offsets on the host): slot i is
    a[rows[i]] * a_scale[rows[i]] times its expert's w * w_scale, transposed (no scales: bf16 operands)."""
    x, out, start = a.float() if a_scale is None else a.float() * a_scale.float()[:, None], [], 0
    for e, end in enumerate(offs.tolist()):
        w_e = w[e].float() if w_scale is None else w[e].float() * w_scale[e][:, None]
        out.append(x[rows[start:end]] @ w_e.t())
        start = end
    return torch.cat(out)


def float_experts(
    m: ScaledExperts, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """What an FP8 `ScaledExperts` computes, in fp32 on any device: the same quantized operands (activations
    quantized as the module does, weights as stored) multiplied expert by expert as floats. The reference
    dgpipe's Triton GEMM is probed against; it reads the routing on the host, so it is no runtime path."""
    routing = sl.expert_order(index, m.num_experts)
    token_of, offs = routing.token_of, routing.offs
    gate_up = float_gemm(*quantize_rows(x, m.in_scale, m.mode), token_of, m.w13, m.s13, offs)
    gate, up = gate_up.chunk(2, dim=-1)
    slots = torch.arange(token_of.shape[0], device=x.device)
    y = float_gemm(*quantize_rows(gelu_tanh(gate) * up, m.down_in_scale, m.mode), slots, m.w2, m.s2, offs)
    return combine_top_k(y, routing, weights.float())


TRITON_FALLBACK = "dgpipe uses the dispatch row's other path; report the GPU, torch and Triton versions"


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-30))


def _check_every_tile(name: str, a, a_scale, rows, w, w_scale, offs) -> torch.Tensor:
    """The Triton GEMM at every tile it can launch with on this GPU (`kernels.moe.probe_tiles`: its default
    M tiles and this GPU's measured table) against the float product of its operands, which it returns, or a
    DgpipeError naming the tile: one bf16 rounding of the output apart; a wrong tile is O(1)."""
    want = float_gemm(a, a_scale, rows, w, w_scale, offs)
    for tile in kernels.moe.probe_tiles(a.device, a.element_size()):
        err = _rel_l2(kernels.moe.launch(tile, a, a_scale, rows, w, w_scale, offs), want)
        if not err < 1e-2:
            raise DgpipeError(f"the {name} ({tile.short()} tiles) differs from the float product of its operands "
                              f"by {err:.3g} (relative L2)", TRITON_FALLBACK)  # fmt: skip
    return want


@dataclass(frozen=True)
class ExpertsProbe:
    """The experts the Triton MoE GEMM's probes run, sized so that every loop and grid axis of the kernel
    goes past its first block: the hidden size, gate|up's K (the GEMM checked at every tile), takes more
    than one step at every K tile the tuner tries (FP8: 64-256 values), the last one partial at 128 and 256
    as the 26B's down projection's 704 does; gate|up's N (384) more than one block at every N tile, the
    last partial at 256; and 150 tokens routed top-2 over 5 experts put 139 rows on expert 0 (more than one
    M block at every M tile, up to 128, the last partial), 37 to 67 on experts 1-3 and none on expert 4
    (most experts at a decode step are chosen by no token)."""

    hidden: int = 320
    intermediate: int = 192
    tokens: int = 150
    experts: int = 5
    crowded: int = 139  # tokens whose first choice is expert 0

    def routing(
        self, dev: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] in `dtype`, the top-2 experts of each token (two distinct ones, expert 4 never)
        and their weights."""
        g = torch.Generator().manual_seed(19)
        others = torch.randint(1, 4, (self.tokens,), generator=g)
        first = torch.where(torch.arange(self.tokens) < self.crowded, 0, others)
        second = torch.where(first == 0, others, 1 + first % 3)  # 1-3, never the first choice
        index = torch.stack([first, second], dim=1)
        x = torch.randn(self.tokens, self.hidden, generator=g)
        return x.to(dev, dtype), index.to(dev), torch.rand(self.tokens, 2, generator=g).to(dev)


EXPERTS_PROBE = ExpertsProbe()


def check_triton_fp8(mode: str, fmt: str, dev: torch.device) -> None:
    """dgpipe's Triton kernels on this GPU against references that need no grouped GEMM kernel (so the check
    runs where torch has none), or a DgpipeError: the GEMM at every M tile it picks against the float
    product of its FP8 operands; and a whole experts pass on it against `float_experts`, on the experts
    and routing of `EXPERTS_PROBE`. Only kernels that agree are used: Triton and its compiler vary by host."""
    p = EXPERTS_PROBE
    gate, up, down = (
        [_tiny_packed(fmt, *shape, seed=i * p.experts + e) for e in range(p.experts)]  # distinct experts
        for i, shape in enumerate([(p.intermediate, p.hidden)] * 2 + [(p.hidden, p.intermediate)])
    )
    m = ScaledExperts(gate, up, down, mode, dev, triton_rows=EVERY_PASS)
    x, index, weights = p.routing(dev, torch.bfloat16)
    q, qs = quantize_rows(x, m.in_scale, mode)
    _, token_of, offs, _ = sl.expert_order(index, m.num_experts)
    _check_every_tile("Triton MoE GEMM", q, qs, token_of, m.w13, m.s13, offs)
    err = _rel_l2(m(x, index, weights), float_experts(m, x, index, weights))
    if not err < 0.1:  # bf16 intermediates flip some FP8 roundings (~0.02, tests/gpu); a wrong kernel is O(1)
        raise DgpipeError(f"experts on the Triton MoE GEMM differ from their float reference by {err:.3g} "
                          "(relative L2)", TRITON_FALLBACK)  # fmt: skip


def check_fp8_columns(dev: torch.device) -> None:
    """FP8 linears that read one input, with a weight scale each, merged into one RowWise GEMM
    (`shared_input.concatenate`): each one's columns against the linear alone, or a DgpipeError. The same
    codes and scales in two GEMMs: within their bf16 outputs' rounding and accumulation orders; a scale or
    a column range out of place is O(1)."""
    from pipeline.runtime.shared_input import SharedInput, concatenate

    parts = [
        ScaledLinear(_tiny_packed("fp8", n, seed=i), "fp8", dev, torch.bfloat16)
        for i, n in enumerate((128, 64, 64))
    ]
    if len({p.static_scales for p in parts}) != len(parts):
        raise AssertionError("the probe's linears must differ in their weight scales")
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9)).to(dev, torch.bfloat16)
    alone = [p(x).float() for p in parts]
    merged = SharedInput(parts, concatenate(parts))(x)
    for i, (got, want) in enumerate(zip(merged, alone, strict=True)):
        err = _rel_l2(got, want)
        if not err < 1e-2:
            raise DgpipeError(f"FP8 linears merged into one RowWise GEMM differ from linear {i} alone by {err:.3g} "
                              "(relative L2)", "dgpipe runs them as one GEMM each; report the GPU, torch and Triton versions")  # fmt: skip


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
        err = _rel_l2(got, combine_slots(y, weights).float())
        if not err < 1e-2:  # bf16 rounding apart; a wrong kernel is O(1)
            raise DgpipeError(f"the Triton MoE combine differs from the batched product by {err:.3g} (relative L2, "
                              f"{dtype})", TRITON_FALLBACK)  # fmt: skip


def spread(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Probe values [rows, cols]: normal draws scaled over seven decades along each row (1e-3 to 1e4), clamped
    to fp16's range so one draw serves bf16 and fp16."""
    return (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 4, cols)).clamp(-6e4, 6e4)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two bf16/fp16 tensors hold the same bit patterns (NaN, infinities and -0.0 included)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


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


# the Triton GEMM's float operand forms ("triton:bf16", "triton:fp16"): the mode names the operands' dtype
FLOAT_OPERANDS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_triton_float(dev: torch.device, dtype: torch.dtype) -> None:
    """dgpipe's Triton GEMM with bf16 or fp16 operands (`dtype`: a model loaded in fp16) on this GPU, or a
    DgpipeError: at every M tile against the float product of its operands, and a whole experts pass on it
    (`pipeline.runtime.routed`) against the same experts in fp32 expert by expert, on the experts and
    routing of `EXPERTS_PROBE`. Run where torch's grouped GEMM has no kernel for `dtype`, so the check needs
    none."""
    name = next(mode for mode, d in FLOAT_OPERANDS.items() if d == dtype)
    p, gen = EXPERTS_PROBE, torch.Generator().manual_seed(1)
    gate_up = torch.randn(p.experts, 2 * p.intermediate, p.hidden, generator=gen).to(dev, dtype) / 16
    down = torch.randn(p.experts, p.hidden, p.intermediate, generator=gen).to(dev, dtype) / 16
    x, index, weights = p.routing(dev, dtype)
    slots = torch.arange(index.numel(), device=dev)
    routing = sl.expert_order(index, p.experts)
    token_of, offs = routing.token_of, routing.offs
    gate, up = _check_every_tile(f"Triton {name} MoE GEMM", x, None, token_of, gate_up, None, offs).chunk(
        2, dim=-1
    )
    want = combine_top_k(
        float_gemm(gelu_tanh(gate) * up, None, slots, down, None, offs), routing, weights.float()
    )
    err = _rel_l2(routed_experts(x, index, weights, gate_up, down, triton=True), want)
    if not err < 2e-2:  # bf16 / fp16 intermediates; a wrong kernel is O(1)
        raise DgpipeError(f"{name} experts on the Triton MoE GEMM differ from their float reference by {err:.3g} "
                          "(relative L2)", TRITON_FALLBACK)  # fmt: skip


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


def same_layer_end(
    got: torch.Tensor, want: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor
) -> bool:
    """Whether two layer ends agree as closely as RMSNorms summing their squares in another order let them:
    within 2^-6 of the value plus 2^-6 of the scaled residual it was summed from (a norm's output a unit of
    2^-7 off, which the residual sum can leave as the whole result where the two cancel), and NaN where the
    other has NaN. A wrong weight, eps or rounding step is off by far more."""
    return _within(got, want, 2.0**-6 * (want.float().abs() + (residual.float() * scale.float()).abs()))


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> bool:
    """got within `bound` of want, or equal (infinities), and NaN where want has NaN."""
    g, w = got.float(), want.float()
    close = ((g - w).abs() <= bound) | (g == w)
    return bool(torch.equal(g.isnan(), w.isnan()) and (close | w.isnan()).all())


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
    return _within(got, want, 2.0**-6 * (outer + inner.nan_to_num(0.0, 0.0, 0.0)))


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


def separated_scores(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router scores [tokens, experts] whose probabilities no rounding can reorder: each row a random
    permutation of steps 1/16 apart around 0 (exact in bf16 up to 256 experts, in fp16 up to 512), so any two
    probabilities differ by a factor of e^(1/16)."""
    return (
        torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).float() - experts // 2
    ) / 16


def same_top_k(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two top-k routings agree as closely as softmax and renormalisation sums added in another
    order let them: the same experts in the same places, each weight within 2^-18 of it (a few fp32
    roundings; a missing renormalisation or scale, or another expert's weight, is off by far more)."""
    (gw, gi), (ww, wi) = got, want
    return torch.equal(gi, wi) and bool(((gw - ww).abs() <= 2.0**-18 * ww.abs()).all())


def check_triton_top_k(dev: torch.device) -> None:
    """dgpipe's top-k kernel against torch's form (`network.route_scores`) on the 26B's routing (128
    experts, top 8, bf16 scores), on fp16 and fp32 scores, and on 100 experts (no power of two) and 4 (top
    2), with random per-expert scales in the scores' dtype: the same experts and weights within a few fp32 roundings
    (`same_top_k`), or a DgpipeError."""
    g = torch.Generator().manual_seed(14)
    for dtype, tokens, experts, k in ((torch.bfloat16, 37, 128, 8), (torch.float16, 37, 128, 8),
                                      (torch.float32, 19, 128, 8), (torch.bfloat16, 5, 100, 8),
                                      (torch.bfloat16, 3, 4, 2)):  # fmt: skip
        scores = separated_scores(tokens, experts, g).to(dev, dtype)
        scale = (torch.rand(experts, generator=g) + 0.5).to(dev, dtype)  # a parameter of the model's dtype
        want = route_scores(scores, k, scale)[1:]
        if not same_top_k(kernels.routing.top_k(scores, k, scale), want):
            raise DgpipeError(
                f"the Triton router top-k differs from torch's ({dtype}, {experts} experts, top {k})",
                TRITON_FALLBACK,
            )


def same_order(got: sl.ExpertOrder, want: sl.ExpertOrder) -> bool:
    """Two orders of the routed slots agree: the same sorted slots, tokens and offsets, and the same sorted
    position of each slot (`scaled_layout.slot_rows`, where either leaves `rows` out)."""
    same = all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    return same and torch.equal(sl.slot_rows(got), sl.slot_rows(want))


# (tokens, top k, experts) of the expert-order probe: the 26B's routing over more slots than one step of
# each of the kernel's sweeps takes, one token's, and (tokens == 9) every slot on one expert
EXPERT_ORDER_CASES = ((600, 8, 128), (1, 8, 128), (9, 2, 4))


def check_triton_expert_order(dev: torch.device) -> None:
    """dgpipe's expert-order kernel against torch's stable sort (`scaled_layout.expert_order`): the 26B's
    routing of 600 tokens (4,800 slots: more than one step of each of the kernel's sweeps, the last partial), one
    token (most experts chosen by none), and every slot on one expert: the same order, tokens, offsets and
    inverse (`same_order`), or a DgpipeError."""
    g = torch.Generator().manual_seed(15)
    for tokens, k, experts in EXPERT_ORDER_CASES:
        index = torch.randint(0, experts, (tokens, k), generator=g)
        if tokens == 9:
            index[:] = 3
        index = index.to(dev)
        if not same_order(kernels.routing.expert_order(index, experts), sl.expert_order(index, experts)):
            raise DgpipeError(
                f"the Triton expert order differs from torch's sort ({tokens} tokens, top {k}, {experts} experts)",
                TRITON_FALLBACK,
            )


# each `kernels.chains` and `kernels.routing` kernel's check, by its probe form's kind
NETWORK_CHECKS = {"rope": check_triton_rope, "softcap": check_triton_softcap, "combine": check_triton_combine,
                  "geglu": check_triton_geglu, "residual": check_triton_residual, "kv_cat": check_triton_kv_cat,
                  "router": check_triton_router, "layer_end": check_triton_layer_end,
                  "ffn_inputs": check_triton_ffn_inputs, "top_k": check_triton_top_k,
                  "expert_order": check_triton_expert_order, "head_norms": check_triton_head_norms,
                  "norm_fp8": check_triton_norm_fp8, "norm_nvfp4": check_triton_norm_nvfp4}  # fmt: skip
assert set(NETWORK_CHECKS) == {kind for kind, _, _ in NETWORK_FORMS}


def probe(
    device: torch.device | str = "cuda",
    formats: tuple[str, ...] = PROBED_FORMATS,
    dtype: torch.dtype = torch.bfloat16,
) -> Probe:
    """Run each GEMM form this GPU's dispatch rows use for checkpoints in `formats` once, on tiny operands,
    the linears writing the model's `dtype` (CUDA only)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise DgpipeError(
            "tensor-core probe needs a CUDA device", "run on a GPU host (dgpipe doctor shows it)"
        )
    p = Probe(arch_of(*torch.cuda.get_device_capability(dev)))
    return run_forms(p, dev, probe_plan(p.arch, formats), dtype)


def run_forms(
    p: Probe, dev: torch.device, forms: list[tuple[str, str, str]], dtype: torch.dtype = torch.bfloat16
) -> Probe:
    """Run each (kind, mode, weight format) form on `dev` and record it in `p`: None where it ran and agreed
    with its reference, else the error. Also how a load adds a form its plan did not know it needed (the
    Triton GEMM for a model loaded in fp16). Triton's interpreter runs the Triton forms on the CPU (tests)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 128, generator=gen).to(dev, dtype)
    index = torch.randint(0, 4, (20, 2), generator=gen).to(dev)
    wts = torch.rand(20, 2, generator=gen).to(dev)
    for kind, mode, fmt in forms:
        name = f"{kind}:{mode}"
        try:
            if kind == "linear":
                ScaledLinear(_tiny_packed(fmt), mode, dev, dtype)(x)
            elif kind == "experts":
                ps = [_tiny_packed(fmt) for _ in range(4)]
                ScaledExperts(ps, ps, ps, mode, dev)(x[:20], index, wts)
            elif kind == "quant":
                check_triton_quant(mode, dev)
            elif kind == "siblings":
                check_fp8_columns(dev)
            elif kind in NETWORK_CHECKS:
                NETWORK_CHECKS[kind](dev)
            elif mode in FLOAT_OPERANDS:
                check_triton_float(dev, FLOAT_OPERANDS[mode])
            else:
                check_triton_fp8(mode, fmt, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            p.results[name] = None
        except Exception as e:  # any failure (a Triton compile error included) sends the form to its fallback
            p.results[name] = error_line(e)
    return p
