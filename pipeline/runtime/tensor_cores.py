"""Quantized checkpoints on CUDA tensor cores: the weights stay FP8 / NVFP4 in GPU memory and torch's
scaled GEMMs do the math, as `pipeline.runtime.dispatch` decides per (format, arch).

`load_on_gpu` loads a quantized checkpoint onto a CUDA device with each quantized linear as a
`ScaledLinear` (`F.scaled_mm`) and each layer's experts as `ScaledExperts` (`F.scaled_grouped_mm`), built
from the packed tensors as ModelOpt stored them, as `pipeline.model.checkpoint.load_model` reads them
(`TensorCoreLoad`), through the pure converters of `pipeline.model.scaled_layout`: no dequantized float
copy of those weights is ever made. Activations are quantized as `pipeline.model.fake_quant` emulates them (FP8: static
per-tensor input scale; NVFP4: dynamic per-16 blocks under the static global scale), so the scaled GEMMs
compute what the CPU path's fake-quantized float GEMMs compute, up to accumulation order. Nothing here
runs on the CPU path: the CPU runtime and the float64 parity oracle are untouched.

Neither module synchronises with the host (routing offsets stay on the device), so a denoise step with
them can be captured in a CUDA graph (`graph_safe = True`).

API (torch >= 2.10's `torch.nn.functional.scaled_mm` / `scaled_grouped_mm` with `ScalingType` and
`SwizzleType`; checked in torch 2.13's sources): `scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b,
scale_recipe_b, swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16, ...)`, and the
grouped form with `offs` (int32 group end offsets). `probe()` runs each kernel once on tiny operands and
reports what this GPU and torch build serve; anything that fails takes the row's fallback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import DgpipeError, error_line
from pipeline.model import scaled_layout as sl
from pipeline.model.checkpoint import Checkpoint, load_model
from pipeline.model.fake_quant import E4M3_MAX, nvfp4_fake_quant
from pipeline.model.files import runtime_name, weight_files
from pipeline.model.modelopt import PackedLinear, quant_algo
from pipeline.model.network import DiffusionGemma, combine_top_k, gelu_tanh
from pipeline.runtime import triton_moe
from pipeline.runtime.dispatch import (
    EVERY_PASS,
    FP8_FAST_ACCUM,
    NO_GROUPED_KERNEL,
    TRITON_BF16,
    TRITON_MOE,
    arch_of,
    dispatch,
)
from pipeline.targets import precision_for_quant_algo

EXPERT = re.compile(r"^(layers\.\d+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def _api():
    """torch's scaled-GEMM API, or a DgpipeError naming what is missing."""
    missing = [
        n for n in ("scaled_mm", "scaled_grouped_mm", "ScalingType", "SwizzleType") if not hasattr(F, n)
    ]
    if missing:
        raise DgpipeError(
            f"torch {torch.__version__} lacks torch.nn.functional.{', '.join(missing)}",
            "tensor-core FP8/NVFP4 needs torch >= 2.10 with CUDA; the float path runs without it",
        )
    return F.ScalingType, F.SwizzleType


def _rowwise_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 operand with one scale per row (fp32 [M])."""
    s = (x.abs().amax(-1).float() / E4M3_MAX).clamp(min=1e-12)  # |x| and its max are exact in x's dtype
    return sl.fp8_quantize(x, s[:, None]), s


# ---- linears -------------------------------------------------------------------------------------------
class ScaledLinear(nn.Module):
    """A quantized linear on `F.scaled_mm`. `mode`: "fp8" (TensorWise), "nvfp4" (BlockWise1x16 +
    TensorWise global scales), "fp8_rowwise" (NVFP4 weights re-quantized to E4M3 per row: Hopper/Ada)."""

    graph_safe = True

    def __init__(
        self, q: PackedLinear, mode: str, device: torch.device, out_dtype: torch.dtype, triton: bool = False
    ):
        super().__init__()
        self.mode, self.out_dtype, self.triton = mode, out_dtype, triton  # triton: `quantize_rows`
        self.out_features = q.weight.shape[0]
        self.register_buffer("input_scale", q.input_scale.reshape(()).to(device))
        if mode == "fp8":
            self.register_buffer("weight", q.weight.to(device))  # [N, K] e4m3; .t() is column-major
            self.register_buffer("weight_scale", q.weight_scale.reshape(()).to(device))
        elif mode == "nvfp4":
            self.register_buffer("weight", sl.as_fp4x2(q.weight).to(device))  # [N, K/2]
            blocked = sl.nvfp4_weight_blocked(q.weight_scale.view(torch.uint8))
            self.register_buffer("weight_scale", blocked.view(torch.float8_e4m3fn).to(device))
            self.register_buffer("weight_scale_2", q.weight_scale_2.reshape(()).to(device))
        elif mode == "fp8_rowwise":
            w, s = sl.fp8_rowwise_weight(q.dequantized())
            self.register_buffer("weight", w.to(device))
            self.register_buffer("weight_scale", s.reshape(1, -1).to(device))
        else:
            raise ValueError(f"unknown scaled-linear mode {mode!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.mode == "fp8":
            a, a_scales, b_scales = (
                quantize_rows(x2, self.input_scale, "fp8", self.triton)[0],
                [self.input_scale],
                [self.weight_scale],
            )
        elif self.mode == "nvfp4":
            a, bs = quantize_rows(x2, self.input_scale, "nvfp4")  # packed codes (uint8), per-16 block scales
            a_scales = [sl.to_blocked(bs.view(torch.uint8)).view(torch.float8_e4m3fn), self.input_scale]
            b_scales = [self.weight_scale, self.weight_scale_2]
        else:
            a, s = quantize_rows(x2, self.input_scale, "fp8_rowwise")
            a_scales, b_scales = [s[:, None]], [self.weight_scale]
        gemm = scaled_gemm_op if torch.compiler.is_compiling() else scaled_gemm
        out = gemm(a, a_scales, self.weight, b_scales, self.mode, self.out_dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def scaled_gemm(
    a: torch.Tensor,
    a_scales: list[torch.Tensor],
    weight: torch.Tensor,
    w_scales: list[torch.Tensor],
    mode: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`F.scaled_mm` of a quantized operand `a` [M, K] (NVFP4: packed codes [M, K/2] as uint8) and a
    `ScaledLinear` weight [N, K], with the scaling recipes of `mode`: [M, N] in `out_dtype`."""
    scaling, swizzle = _api()
    if mode == "fp8":
        return F.scaled_mm(
            a, weight.t(), a_scales[0], scaling.TensorWise, w_scales[0], scaling.TensorWise, output_dtype=out_dtype,
            use_fast_accum=FP8_FAST_ACCUM,
        )  # fmt: skip
    if mode == "nvfp4":
        return F.scaled_mm(
            sl.as_fp4x2(a), weight.t(), a_scales, [scaling.BlockWise1x16, scaling.TensorWise],
            w_scales, [scaling.BlockWise1x16, scaling.TensorWise],
            swizzle_a=swizzle.SWIZZLE_32_4_4, swizzle_b=swizzle.SWIZZLE_32_4_4, output_dtype=out_dtype,
        )  # fmt: skip
    return F.scaled_mm(
        a, weight.t(), a_scales[0], scaling.RowWise, w_scales[0], scaling.RowWise, output_dtype=out_dtype,
        use_fast_accum=FP8_FAST_ACCUM,
    )  # fmt: skip


# ---- experts -------------------------------------------------------------------------------------------
def _stack(ps: list[PackedLinear], attr: str) -> torch.Tensor:
    return torch.stack([getattr(p, attr) for p in ps])


class ScaledExperts(nn.Module):
    """A layer's routed experts on `F.scaled_grouped_mm`: slots sorted by expert (device-side offsets),
    one grouped GEMM for gate|up and one for down. `mode` as in `ScaledLinear` ("fp8" is RowWise here: the
    grouped FP8 kernel takes per-row scales, so each expert's per-tensor weight scale fills its rows). The
    output has the input's dtype (the grouped kernels compute in bf16: `scaled_experts`). `triton_rows`: the
    dispatch row's, where the probe found dgpipe's Triton kernels agreeing with the float product (FP8
    passes with at most that many rows per expert take `triton_moe`'s GEMM, FP8 activations its one-pass
    quantization; 0: torch's kernels only, `dispatch.EVERY_PASS`: the Triton GEMM only)."""

    graph_safe = True

    def __init__(
        self,
        gate: list[PackedLinear],
        up: list[PackedLinear],
        down: list[PackedLinear],
        mode: str,
        device: torch.device,
        triton_rows: float = 0.0,
    ):
        super().__init__()
        self.mode, self.num_experts = mode, len(gate)
        self.triton_rows = triton_rows if mode != "nvfp4" else 0.0
        # ModelOpt shares one input quantizer per projection across a layer's experts (max over experts)
        self.register_buffer(
            "in_scale", torch.stack([p.input_scale.reshape(()) for p in gate + up]).max().to(device)
        )
        self.register_buffer(
            "down_in_scale", torch.stack([p.input_scale.reshape(()) for p in down]).max().to(device)
        )
        gate_up = [
            PackedLinear(g.algo, torch.cat([g.weight, u.weight])) for g, u in zip(gate, up, strict=True)
        ]
        if mode == "fp8":
            w13 = torch.stack([p.weight for p in gate_up])  # [E, 2I, d] e4m3
            s13 = torch.stack(
                [
                    torch.cat(
                        [g.weight_scale.expand(g.weight.shape[0]), u.weight_scale.expand(u.weight.shape[0])]
                    )
                    for g, u in zip(gate, up, strict=True)
                ]
            )
            self._set("w13", w13, s13, device)
            self._set(
                "w2",
                _stack(down, "weight"),
                sl.fp8_expert_row_scales(_stack(down, "weight_scale"), down[0].weight.shape[0]),
                device,
            )
        elif mode == "fp8_rowwise":
            w13 = torch.stack(
                [torch.cat([g.dequantized(), u.dequantized()]) for g, u in zip(gate, up, strict=True)]
            )
            self._set("w13", *sl.fp8_rowwise_weight(w13), device)
            self._set("w2", *sl.fp8_rowwise_weight(torch.stack([p.dequantized() for p in down])), device)
        elif mode == "nvfp4":
            bs13 = torch.stack(
                [torch.cat([g.weight_scale, u.weight_scale]) for g, u in zip(gate, up, strict=True)]
            )
            gs = torch.stack([g.weight_scale_2.reshape(()) for g in gate])
            if not torch.equal(gs, torch.stack([u.weight_scale_2.reshape(()) for u in up])):
                raise DgpipeError(
                    "NVFP4 experts with different gate_proj and up_proj global scales",
                    "export the checkpoint with ModelOpt's fused gate/up scales (its default)",
                )
            self._set("w13", sl.as_fp4x2(torch.stack([p.weight for p in gate_up])), None, device)
            self.register_buffer(
                "s13", sl.nvfp4_weight_blocked(bs13.view(torch.uint8)).view(torch.float8_e4m3fn).to(device)
            )
            self.register_buffer("g13", gs.float().to(device))
            self._set("w2", sl.as_fp4x2(_stack(down, "weight")), None, device)
            self.register_buffer(
                "s2",
                sl.nvfp4_weight_blocked(_stack(down, "weight_scale").view(torch.uint8))
                .view(torch.float8_e4m3fn)
                .to(device),
            )
            self.register_buffer(
                "g2", torch.stack([p.weight_scale_2.reshape(()) for p in down]).float().to(device)
            )
        else:
            raise ValueError(f"unknown scaled-experts mode {mode!r}")

    def _set(self, name: str, w: torch.Tensor, s: torch.Tensor | None, device: torch.device) -> None:
        self.register_buffer(name, w.contiguous().to(device))
        if s is not None:
            self.register_buffer(name.replace("w", "s"), s.float().contiguous().to(device))

    def _weights(self) -> tuple[torch.Tensor | None, ...]:
        """(w13, s13, g13, w2, s2, g2): the packed weights and their scales (g*: NVFP4 global scales)."""
        g = lambda n: getattr(self, n, None)
        return g("w13"), g("s13"), g("g13"), g("w2"), g("s2"), g("g2")

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        scales = (self.in_scale, self.down_in_scale)
        return scaled_experts(x, index, weights, *self._weights(), *scales, self.mode, self.triton_rows)


def quantize_rows(
    x: torch.Tensor, in_scale: torch.Tensor, mode: str, triton: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operand of x's rows and its scales: FP8 with the static scale per row (fp8), per-row E4M3
    of the NVFP4-rounded rows (fp8_rowwise), or NVFP4 codes and their per-16 block scales (nvfp4). Each
    row is quantized on its own, so quantizing before a row gather equals quantizing the gathered rows.
    `triton`: the static FP8 quantization in one pass on CUDA (`triton_moe.quantize`), except under
    torch.compile, which fuses the torch form into its producer."""
    if mode == "fp8":
        one_pass = triton and x.is_cuda and not torch.compiler.is_compiling()
        q = triton_moe.quantize(x, in_scale) if one_pass else sl.fp8_quantize(x, in_scale)
        return q, in_scale.float().expand(x.shape[0])
    if mode == "fp8_rowwise":
        return _rowwise_dynamic(nvfp4_fake_quant(x, in_scale))
    return sl.nvfp4_quantize(x, in_scale)


def grouped_gemm(
    q: torch.Tensor,
    qs: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor | None,
    in_scale: torch.Tensor,
    offs: torch.Tensor,
    mode: str,
    fast_accum: bool = FP8_FAST_ACCUM,
) -> torch.Tensor:
    """One grouped scaled GEMM: expert-sorted operand rows `q` (scales `qs`) times `w` [E, N, K] packed
    (scales `s`, NVFP4 global scales `g`), bf16 out (the only output torch's grouped FP8/FP4 kernels write).
    `fast_accum`: FP8 accumulation mode (`FP8_FAST_ACCUM`; the benchmark times the other one too)."""
    scaling, swizzle = _api()
    weight, num_experts = w.transpose(-2, -1), w.shape[0]
    if mode == "nvfp4":
        a_scale = sl.to_blocked_grouped(qs.view(torch.uint8), offs).view(torch.float8_e4m3fn)
        return F.scaled_grouped_mm(
            sl.as_fp4x2(q), weight,
            [a_scale, in_scale.expand(num_experts).contiguous()], [scaling.BlockWise1x16, scaling.TensorWise],
            [s, g], [scaling.BlockWise1x16, scaling.TensorWise],
            swizzle_a=swizzle.SWIZZLE_32_4_4, swizzle_b=swizzle.SWIZZLE_32_4_4, offs=offs, output_dtype=torch.bfloat16,
        )  # fmt: skip
    return F.scaled_grouped_mm(
        q, weight, qs.contiguous(), scaling.RowWise, s, scaling.RowWise, offs=offs, output_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )  # fmt: skip


def scaled_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    g13: torch.Tensor | None,
    w2: torch.Tensor,
    s2: torch.Tensor,
    g2: torch.Tensor | None,
    in_scale: torch.Tensor,
    down_in_scale: torch.Tensor,
    mode: str,
    triton_rows: float = 0.0,
) -> torch.Tensor:
    """A layer's routed experts: slots sorted by expert (device-side offsets, no host sync), one grouped
    scaled GEMM for gate|up and one for down, each token's top-k outputs weighted and summed. An FP8 pass
    with at most `triton_rows` slots per expert (`triton_moe.serves`) runs both GEMMs on `triton_moe`'s
    kernel, which gathers the token rows itself; with `triton_rows`, FP8 activations are quantized in one
    pass.

    The tokens are quantized once and their 1-byte (FP8) or half-byte (NVFP4) rows gathered top_k times,
    not gathered in bf16 and quantized top_k times over; the outputs go back to slot order with one
    permutation and each token's k rows are combined by one batched product (fp32 accumulation, no
    atomics, deterministic), not scattered with bf16 atomic adds. On an H200 at batch 16 those two
    element-wise paths took most of the experts' non-GEMM time (BENCHMARKS.md, "26B-A4B denoise pass")."""
    order, token_of, offs = sl.expert_order(index, w13.shape[0])
    compiling, triton = torch.compiler.is_compiling(), triton_rows > 0
    if triton_moe.serves(token_of.shape[0], w13.shape[0], triton_rows):
        small = triton_moe.moe_gemm_op if compiling else triton_moe.moe_gemm
        gate_up_gemm = lambda q, qs: small(q, qs, token_of, w13, s13, offs)
        down_gemm = lambda q, qs: small(q, qs, None, w2, s2, offs)
    else:
        gemm = grouped_gemm_op if compiling else grouped_gemm
        gate_up_gemm = lambda q, qs: gemm(q[token_of], qs[token_of], w13, s13, g13, in_scale, offs, mode)
        down_gemm = lambda q, qs: gemm(q, qs, w2, s2, g2, down_in_scale, offs, mode)
    gate, up = gate_up_gemm(*quantize_rows(x, in_scale, mode, triton)).chunk(2, dim=-1)
    y = down_gemm(*quantize_rows(gelu_tanh(gate) * up, down_in_scale, mode, triton))
    return combine_top_k(y, order, weights).to(x.dtype)


# The two vendor GEMM calls as custom ops, opaque to the compiler, used under --compile. Dynamo cannot trace
# torch 2.11's `_scaled_mm_v2` builtin: each scaled linear broke the graph, and on an H200 the 26B's FP8
# pass hit dynamo's recompile limit and ran those frames eagerly. As ops with fake kernels (output shape
# and dtype only) they keep the graph whole, and inductor fuses what surrounds them: the activations'
# quantization, the routing gathers, the gating and the combine. Registered at import: registering inside
# a compiled region is itself a graph break.
scaled_gemm_op = torch.library.custom_op("dgpipe::scaled_gemm", mutates_args=())(scaled_gemm)
scaled_gemm_op.register_fake(
    lambda a, a_scales, weight, w_scales, mode, out_dtype: a.new_empty(
        (a.shape[0], weight.shape[0]), dtype=out_dtype
    )
)
grouped_gemm_op = torch.library.custom_op("dgpipe::grouped_scaled_gemm", mutates_args=())(grouped_gemm)
grouped_gemm_op.register_fake(
    lambda q, qs, w, s, g, in_scale, offs, mode, fast_accum=FP8_FAST_ACCUM: q.new_empty(
        (q.shape[0], w.shape[1]), dtype=torch.bfloat16
    )
)


# ---- probing and installing ---------------------------------------------------------------------------
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


def random_packed(
    fmt: str, n: int, k: int, device: torch.device, gen: torch.Generator | None = None
) -> PackedLinear:
    """A random quantized linear in ModelOpt's stored layout, drawn on `device` (the random-weight
    benchmark of a full-size configuration: no checkpoint, no host copy): weights ~ N(0, 0.02)."""
    if fmt == "fp8":
        w = (torch.randn(n, k, device=device, generator=gen) * (E4M3_MAX / 4)).clamp(-E4M3_MAX, E4M3_MAX)
        # clamped first: unclamped, the 26B's routing on an H200 collapsed onto top-k experts (NaN router inputs)
        w = w.to(torch.float8_e4m3fn)
        return PackedLinear("FP8", w, torch.tensor(0.02 * 4 / E4M3_MAX, device=device), None,
                            torch.tensor(8.0 / E4M3_MAX, device=device))  # fmt: skip
    codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=gen)
    bs = torch.full((n, k // 16), 64.0, device=device).to(torch.float8_e4m3fn)
    return PackedLinear("NVFP4", codes, bs, torch.tensor(0.02 / (64 * 2), device=device),
                        torch.tensor(8.0 / (6 * E4M3_MAX), device=device))  # fmt: skip


PROBED_FORMATS = ("fp8", "nvfp4", "bf16", "int4_awq")


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
                ("triton", row.experts, row.triton))  # fmt: skip
        for kind, kernel, used in uses:
            mode = kernel_mode(kernel) if used else None
            form = (kind, mode, {"fp8": "fp8", "bf16": "bf16"}.get(mode or "", "nvfp4"))
            if mode and form not in plan:
                plan.append(form)
    return plan


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
    """`triton_moe.moe_gemm` in fp32 expert by expert (it reads the end offsets on the host): slot i is
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
    order, token_of, offs = sl.expert_order(index, m.num_experts)
    gate_up = float_gemm(*quantize_rows(x, m.in_scale, m.mode), token_of, m.w13, m.s13, offs)
    gate, up = gate_up.chunk(2, dim=-1)
    slots = torch.arange(token_of.shape[0], device=x.device)
    y = float_gemm(*quantize_rows(gelu_tanh(gate) * up, m.down_in_scale, m.mode), slots, m.w2, m.s2, offs)
    return combine_top_k(y, order, weights.float())


TRITON_FALLBACK = "dgpipe uses the dispatch row's other path; report the GPU, torch and Triton versions"


def _check_triton(mode: str, fmt: str, dev: torch.device, x, index, weights) -> None:
    """dgpipe's Triton kernels on this GPU against references that need no grouped GEMM kernel (so the check
    runs where torch has none), or a DgpipeError: the GEMM at every M tile it picks against the float
    product of its FP8 operands; a whole experts pass on it (10 rows per expert here) against
    `float_experts`; and the one-pass FP8 quantization bit for bit against torch's three passes on normal,
    subnormal, tie, out-of-range and non-finite values. Only kernels that agree are used: Triton and its
    compiler vary by host."""
    ps = [_tiny_packed(fmt, seed=e) for e in range(4)]  # distinct experts: a routing error shows
    m = ScaledExperts(ps, ps, ps, mode, dev, triton_rows=EVERY_PASS)
    rel = lambda got, want: float((got.float() - want).norm() / want.norm().clamp(min=1e-30))
    q, qs = quantize_rows(x, m.in_scale, mode)
    _, token_of, offs = sl.expert_order(index, m.num_experts)
    want = float_gemm(q, qs, token_of, m.w13, m.s13, offs)
    for block_m in triton_moe.BLOCK_MS:  # one bf16 rounding of the output; a wrong tile is O(1)
        err = rel(triton_moe.moe_gemm(q, qs, token_of, m.w13, m.s13, offs, block_m), want)
        if not err < 1e-2:
            raise DgpipeError(f"the Triton MoE GEMM ({block_m}-row tiles) differs from the float product of "
                              f"its operands by {err:.3g} (relative L2)", TRITON_FALLBACK)  # fmt: skip
    err = rel(m(x, index, weights), float_experts(m, x, index, weights))
    if not err < 0.1:  # bf16 intermediates flip some FP8 roundings (~0.02, tests/gpu); a wrong kernel is O(1)
        raise DgpipeError(f"experts on the Triton MoE GEMM differ from their float reference by {err:.3g} "
                          "(relative L2)", TRITON_FALLBACK)  # fmt: skip
    v = torch.tensor(QUANT_PROBE_VALUES)
    v = torch.cat([v, -v, torch.randn(4096) * 64]).to(dev, torch.bfloat16)
    scale = torch.tensor(0.5, device=dev)
    if not fp8_codes_equal(triton_moe.quantize(v, scale), sl.fp8_quantize(v, scale)):
        raise DgpipeError("the Triton FP8 quantization differs from torch's", TRITON_FALLBACK)


def _check_triton_bf16(dev: torch.device, x, index, weights) -> None:
    """dgpipe's Triton GEMM with bf16 operands on this GPU, or a DgpipeError: at every M tile against the
    float product of its operands, and a whole experts pass on it (`pipeline.runtime.routed`) against the
    same experts in fp32 expert by expert. Run where torch's grouped GEMM has no kernel, so the check needs
    none."""
    from pipeline.runtime.routed import routed_experts

    gen = torch.Generator().manual_seed(1)
    gate_up, down = (torch.randn(4, n, 128, generator=gen).to(dev, torch.bfloat16) / 8 for n in (256, 128))
    x, slots = x.to(torch.bfloat16), torch.arange(index.numel(), device=dev)
    order, token_of, offs = sl.expert_order(index, 4)
    rel = lambda got, want: float((got.float() - want).norm() / want.norm().clamp(min=1e-30))
    want = float_gemm(x, None, token_of, gate_up, None, offs)
    for block_m in triton_moe.BLOCK_MS:  # one bf16 rounding of the output; a wrong tile is O(1)
        err = rel(triton_moe.moe_gemm(x, None, token_of, gate_up, None, offs, block_m), want)
        if not err < 1e-2:
            raise DgpipeError(f"the Triton bf16 MoE GEMM ({block_m}-row tiles) differs from the float product "
                              f"of its operands by {err:.3g} (relative L2)", TRITON_FALLBACK)  # fmt: skip
    gate, up = want.chunk(2, dim=-1)
    want = combine_top_k(
        float_gemm(gelu_tanh(gate) * up, None, slots, down, None, offs), order, weights.float()
    )
    err = rel(routed_experts(x, index, weights, gate_up, down, triton=True), want)
    if not err < 2e-2:  # bf16 intermediates; a wrong kernel is O(1)
        raise DgpipeError(f"bf16 experts on the Triton MoE GEMM differ from their float reference by {err:.3g} "
                          "(relative L2)", TRITON_FALLBACK)  # fmt: skip


def probe(device: torch.device | str = "cuda", formats: tuple[str, ...] = PROBED_FORMATS) -> Probe:
    """Run each GEMM form this GPU's dispatch rows use for checkpoints in `formats` once, on tiny operands
    (CUDA only)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise DgpipeError(
            "tensor-core probe needs a CUDA device", "run on a GPU host (dgpipe doctor shows it)"
        )
    p = Probe(arch_of(*torch.cuda.get_device_capability(dev)))
    x = torch.randn(40, 128, device=dev, dtype=torch.bfloat16)
    index = torch.randint(0, 4, (20, 2), device=dev)
    wts = torch.rand(20, 2, device=dev)
    for kind, mode, fmt in probe_plan(p.arch, formats):
        name = f"{kind}:{mode}"
        try:
            if kind == "linear":
                ScaledLinear(_tiny_packed(fmt), mode, dev, torch.bfloat16)(x)
            elif kind == "experts":
                ps = [_tiny_packed(fmt) for _ in range(4)]
                ScaledExperts(ps, ps, ps, mode, dev)(x[:20], index, wts)
            elif mode == "bf16":
                _check_triton_bf16(dev, x[:20], index, wts)
            else:
                _check_triton(mode, fmt, dev, x[:20], index, wts)
            torch.cuda.synchronize(dev)
            p.results[name] = None
        except Exception as e:  # any failure (a Triton compile error included) sends the form to its fallback
            p.results[name] = error_line(e)
    return p


_MODE = {"F.scaled_mm FP8 TensorWise": "fp8", "F.scaled_mm NVFP4": "nvfp4", "F.scaled_mm FP8 RowWise": "fp8_rowwise",
         "F.scaled_grouped_mm FP8 RowWise (weights": "fp8_rowwise", "F.scaled_grouped_mm FP8 RowWise": "fp8",
         "F.scaled_grouped_mm NVFP4": "nvfp4", "Triton FP8 MoE GEMM RowWise (weights": "fp8_rowwise",
         "Triton FP8 MoE GEMM RowWise": "fp8", TRITON_BF16: "bf16"}  # fmt: skip


def kernel_mode(kernel: str) -> str | None:
    """The ScaledLinear/ScaledExperts mode that implements a dispatch-table kernel ("bf16": the float experts
    on dgpipe's Triton GEMM, `pipeline.runtime.routed`); None: a float path on torch's kernels."""
    return next((m for prefix, m in _MODE.items() if kernel.startswith(prefix)), None)


@dataclass
class Installed:
    """What a load put on tensor cores, which float experts route on the device, and what stayed on a
    host-syncing or dequantized float path and why."""

    format: str
    arch: str | None
    linears: int = 0  # linears on scaled_mm
    experts: int = 0  # layers whose experts are on scaled_grouped_mm (or the Triton FP8 GEMM)
    routed: int = 0  # layers whose float experts route on the device (`pipeline.runtime.routed`)
    routed_kernel: str = ""
    fallbacks: list[str] = field(default_factory=list)

    def summary(self) -> str:
        head = f"{self.format} on {self.arch or 'this GPU'}: {self.linears} linears and {self.experts} layers' experts on tensor cores"
        routed = [f"{self.routed} layers' float experts on {self.routed_kernel}"] if self.routed else []
        return "; ".join([head, *routed, *self.fallbacks])


class TensorCoreLoad:
    """The `pipeline.model.checkpoint.PackedSink` that puts a quantized checkpoint on tensor cores while the
    loader reads it: each packed weight goes to the GPU as stored and becomes a `ScaledLinear`, and a
    layer's experts become one `ScaledExperts` as soon as all of them are in. The float copy the CPU path
    dequantizes is never made, so loading needs the checkpoint's size in GPU memory, not its float size
    (a 26B FP8 checkpoint: ~27 GB instead of ~52 GB of bf16), and the host holds one tensor at a time.

    Which linears and experts it takes is decided from the tensor names before any weight is read: the
    kernels of this GPU's dispatch row that passed `probe`, for linears with an input scale, and for
    layers whose experts all have one (a layer's experts share their projections' input quantizers)."""

    def __init__(
        self, path: str | Path, device: torch.device, dtype: torch.dtype, probed: Probe | None = None
    ):
        p = Path(path)
        self.device, self.dtype = device, dtype
        self.probed = pr = probed or probe(device)
        self.report = Installed(precision_for_quant_algo(quant_algo(p)).name, pr.arch)
        self.lin_mode, self.exp_mode, self.triton_rows, row = self._modes(pr)
        names = weight_files(p)
        scaled = {
            runtime_name(n.removesuffix("input_scale") + "weight")
            for n in names
            if n.endswith(".input_scale")
        }
        scaled = {t.removesuffix(".weight") for t in scaled if t}
        experts: dict[str, set[str]] = {}
        for n in names:
            m = EXPERT.match((runtime_name(n) or "").removesuffix(".weight"))
            if m:
                experts.setdefault(m.group(1), set()).add(m.group(0))
        self.linears = {m for m in scaled if not EXPERT.match(m)} if self.lin_mode else set()
        self.expert_layers = {k: len(v) for k, v in experts.items() if self.exp_mode and v <= scaled}
        self.modules: dict[str, nn.Module] = {}
        self.pending: dict[str, dict[int, dict[str, PackedLinear]]] = {}
        if row is not None and row.fallback:
            self.report.fallbacks.append(f"{row.fallback}: {row.note}")

    def _modes(self, pr: Probe):
        """(linear mode, experts mode, Triton, dispatch row) for this format on this GPU, after the probe;
        each kernel that is missing or failed its probe is reported and left to the float path."""
        fmt, res = self.report.format, self.report
        if pr.arch is None or fmt not in ("fp8", "nvfp4"):
            res.fallbacks.append(
                f"{fmt} on {pr.arch or 'this GPU'}: no tensor-core row; dequantized float path"
            )
            return None, None, False, None
        row = dispatch(fmt, pr.arch)
        lin, exp = kernel_mode(row.linears), kernel_mode(row.experts)
        if lin and not pr.ok(f"linear:{lin}"):
            res.fallbacks.append(
                f"linears: {row.linears} failed its probe ({pr.results.get(f'linear:{lin}')})"
            )
            lin = None
        kernel = "experts" if row.torch_experts else "triton"  # the kernel every pass can take
        if exp and not pr.ok(f"{kernel}:{exp}"):
            res.fallbacks.append(
                f"experts: {row.experts} failed its probe ({pr.results.get(f'{kernel}:{exp}')}): "
                "dequantized float path"
            )
            exp = None
        triton_rows = row.triton_rows if exp else 0.0
        if triton_rows and not pr.ok(f"triton:{exp}"):
            res.fallbacks.append(
                f"dgpipe's Triton kernels ({TRITON_MOE}, FP8 quantization) failed their probe "
                f"({pr.results.get(f'triton:{exp}')}): torch's grouped GEMM and quantization run every pass"
            )
            triton_rows = 0.0
        return lin, exp, triton_rows, row

    def wants(self, module: str) -> bool:
        m = EXPERT.match(module)
        return m.group(1) in self.expert_layers if m else module in self.linears

    def take(self, module: str, q: PackedLinear) -> None:
        q = q.to(self.device)
        m = EXPERT.match(module)
        if m is None:
            triton = self.triton_rows > 0  # the one-pass FP8 quantization
            self.modules[module] = ScaledLinear(q, self.lin_mode, self.device, self.dtype, triton)
            self.report.linears += 1
            return
        prefix = m.group(1)
        layer = self.pending.setdefault(prefix, {})
        layer.setdefault(int(m.group(2)), {})[m.group(3)] = q
        if sum(map(len, layer.values())) == self.expert_layers[prefix]:  # the layer's last projection
            per = [layer[e] for e in sorted(self.pending.pop(prefix))]
            proj = lambda name: [e[name] for e in per]
            projections = proj("gate_proj"), proj("up_proj"), proj("down_proj")
            self.modules[prefix] = ScaledExperts(*projections, self.exp_mode, self.device, self.triton_rows)
            self.report.experts += 1

    def install(self, model: DiffusionGemma) -> None:
        if self.pending:
            raise DgpipeError(f"experts of {', '.join(self.pending)} incomplete in the checkpoint")
        for name, module in self.modules.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
        self.modules.clear()


def load_on_gpu(
    path: str | Path, dtype: torch.dtype, device: torch.device, probed: Probe | None = None
) -> tuple[DiffusionGemma, Checkpoint, Installed | None]:
    """`load_model` for a GPU: a quantized checkpoint's FP8 / NVFP4 weights go straight onto tensor cores
    (`TensorCoreLoad`), and float experts that would read their routing on the host (`route_float_experts`)
    route on the device; what did not is reported (None: nothing to report, a bf16 checkpoint on a GPU whose
    grouped GEMM serves it). `probed`: the kernels known to run here (tests pass one to run this off a GPU)."""
    report = None
    if quant_algo(Path(path)) is None:
        model, ckpt = load_model(path, dtype, device)
    else:
        sink = TensorCoreLoad(path, device, dtype, probed)
        model, ckpt = load_model(path, dtype, device, packed=sink)
        report, probed = sink.report, sink.probed
    report = route_float_experts(model, device, probed, report)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, ckpt, report


def route_float_experts(
    model: DiffusionGemma, device: torch.device, probed: Probe | None, report: Installed | None
) -> Installed | None:
    """Float experts that would read the routing on the host (`routed.host_bound_experts`) computed on the
    device instead (`routed.RoutedExperts`): on torch's `F.grouped_mm`, or where it has no kernel on dgpipe's
    Triton GEMM if it passed its probe (run here for that form alone when the load has not probed)."""
    from pipeline.runtime.routed import host_bound_experts, route_on_device

    arch = probed.arch if probed is not None else _cuda_arch(device)
    no_kernel = arch in NO_GROUPED_KERNEL
    layers = host_bound_experts(model, no_kernel)
    if not layers:
        return report
    report = report or Installed("bf16", arch)
    if no_kernel:
        probed = probed or probe(device, formats=("bf16",))
        if not probed.ok("triton:bf16"):
            report.fallbacks.append(
                f"float experts: {TRITON_BF16} failed its probe ({probed.results.get('triton:bf16')}): "
                "torch's per-expert loop, host sync, no CUDA graphs"
            )
            return report
    route_on_device(model, layers, triton=no_kernel)
    report.routed, report.routed_kernel = len(layers), TRITON_BF16 if no_kernel else "F.grouped_mm bf16"
    return report


def _cuda_arch(device: torch.device) -> str | None:
    return arch_of(*torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
