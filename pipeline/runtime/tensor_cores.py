"""Tensor-core linears and experts: quantized weights stay FP8 / NVFP4 in GPU memory and torch's scaled
GEMMs (or dgpipe's Triton MoE GEMM) do the math, as `pipeline.runtime.dispatch` decides per (format, arch).

`ScaledLinear` (`F.scaled_mm`) and `ScaledExperts` (`F.scaled_grouped_mm`; `kernels.moe.moe_gemm` where the
row says) are built from the packed tensors as ModelOpt stored them, through the pure converters of
`pipeline.model.scaled_layout`: no dequantized float copy of those weights is ever made
(`pipeline.runtime.gpu_load` puts them in a model as the checkpoint is read; `pipeline.runtime.probe` finds
which kernels this GPU runs). Activations are quantized as `pipeline.model.fake_quant` emulates them (FP8:
static per-tensor input scale; NVFP4: dynamic per-16 blocks under the static global scale), so the scaled
GEMMs compute what the CPU path's fake-quantized float GEMMs compute, up to accumulation order. Nothing here
runs on the CPU path: the CPU runtime and the float64 parity oracle are untouched.

Neither module synchronises with the host (routing offsets stay on the device), so a denoise step with
them can be captured in a CUDA graph (`graph_safe = True`).

API (torch >= 2.10's `torch.nn.functional.scaled_mm` / `scaled_grouped_mm` with `ScalingType` and
`SwizzleType`; checked in torch 2.13's sources): `scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b,
scale_recipe_b, swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16, ...)`, and the
grouped form with `offs` (int32 group end offsets). Where a recipe has two levels (NVFP4's block scales and
global scale), `F.scaled_mm` on CUDA takes a swizzle per scale (`check_swizzle_lengths` in ATen's
`cuda/ScaledBlas.cpp`, and torch's own NVFP4 samples in `common_methods_invocations.py`); its meta
function reads the first alone, so `pipeline.bench.gpu.fake_cuda` adds that check to the CPU rehearsals.
The grouped form's NVFP4 case reads no swizzle in torch 2.13, and newer ATen (`GroupedBlas.cpp`,
`normalize_grouped_swizzles`) takes exactly that pair: it is given the pair too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import E4M3_MAX, nvfp4_fake_quant
from pipeline.model.modelopt import PackedLinear
from pipeline.model.network import CombineKernel, combine_slots, combine_top_k, geglu
from pipeline.runtime import kernels
from pipeline.runtime.dispatch import FP8_FAST_ACCUM


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
    TensorWise global scales), "fp8_rowwise" (NVFP4 weights re-quantized to E4M3 per row: Hopper/Ada), or
    "fp8_columns": FP8 linears that read one input, side by side, each with its own weight scale (built by
    `shared_input.concatenate`, not from a checkpoint): RowWise, the per-tensor scales in the columns'."""

    graph_safe = True

    def __init__(
        self, q: PackedLinear, mode: str, device: torch.device, out_dtype: torch.dtype, triton: bool = False
    ):
        super().__init__()
        self.mode, self.out_dtype, self.triton = mode, out_dtype, triton  # triton: `quantize_rows`'s
        self.out_features = q.weight.shape[0]
        # the per-tensor scales as numbers (input; FP8 weight or NVFP4 global), read once at load: which
        # linears that read one input can share its quantization and their GEMM (`shared_input`)
        per_tensor = {"fp8": q.weight_scale, "nvfp4": q.weight_scale_2}.get(mode)
        self.static_scales = tuple(float(t) for t in (q.input_scale, per_tensor) if t is not None)
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
        out = self.gemm(*self.quantize(x.reshape(-1, x.shape[-1])))
        return out.reshape(*x.shape[:-1], self.out_features)

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The GEMM's operand of x's rows [M, K] and its scales. It depends on the mode and the input scale
        only, so linears that read one input and agree on both can share it (`pipeline.runtime.shared_input`)."""
        if self.mode == "fp8":
            return quantize_rows(x2, self.input_scale, "fp8", self.triton)[0], [self.input_scale]
        if self.mode == "nvfp4":  # packed codes (uint8), per-16 block scales swizzled, the global scale
            if in_one_pass(self.triton, x2):  # the kernel writes the scales swizzled
                a, bs = kernels.quant.nvfp4_blocked(x2, self.input_scale)
            else:
                a, bs = sl.nvfp4_quantize(x2, self.input_scale)
                bs = sl.to_blocked(bs.view(torch.uint8))
            return a, [bs.view(torch.float8_e4m3fn), self.input_scale]
        a, s = quantize_rows(x2, self.input_scale, "fp8_rowwise", self.triton)
        return a, [s[:, None]]

    def gemm(self, a: torch.Tensor, a_scales: list[torch.Tensor]) -> torch.Tensor:
        """[M, out_features] from `quantize`'s operand."""
        if self.mode == "nvfp4":
            w_scales = [self.weight_scale, self.weight_scale_2]
        else:
            w_scales = [self.weight_scale]
        gemm = scaled_gemm_op if torch.compiler.is_compiling() else scaled_gemm
        return gemm(a, a_scales, self.weight, w_scales, self.mode, self.out_dtype)


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
    scaling, _ = _api()
    if mode == "fp8":
        return F.scaled_mm(
            a, weight.t(), a_scales[0], scaling.TensorWise, w_scales[0], scaling.TensorWise, output_dtype=out_dtype,
            use_fast_accum=FP8_FAST_ACCUM,
        )  # fmt: skip
    rowwise = rowwise_output_dtype(out_dtype, a.device)
    if mode == "fp8_columns":  # the static input scale is folded into the column scales: rows scaled by 1
        return F.scaled_mm(
            a, weight.t(), unit_row_scales(a.shape[0], a.device), scaling.RowWise, w_scales[0], scaling.RowWise,
            output_dtype=rowwise, use_fast_accum=FP8_FAST_ACCUM,
        ).to(out_dtype)  # fmt: skip
    if mode == "nvfp4":
        recipe, swizzles = nvfp4_recipe()
        return F.scaled_mm(
            sl.as_fp4x2(a), weight.t(), a_scales, recipe, w_scales, recipe, swizzle_a=swizzles, swizzle_b=swizzles,
            output_dtype=out_dtype,
        )  # fmt: skip
    return F.scaled_mm(
        a, weight.t(), a_scales[0], scaling.RowWise, w_scales[0], scaling.RowWise, output_dtype=rowwise,
        use_fast_accum=FP8_FAST_ACCUM,
    ).to(out_dtype)  # fmt: skip


def nvfp4_recipe() -> tuple[list, list]:
    """NVFP4's two-level scaling, the same for both operands of a scaled GEMM: block scales per 16 values and
    a global scale, and one swizzle per scale (CUDA's kernels refuse a single one): the block scales in the
    32x4x4 layout, the global scale as it is."""
    scaling, swizzle = _api()
    return [scaling.BlockWise1x16, scaling.TensorWise], [swizzle.SWIZZLE_32_4_4, swizzle.NO_SWIZZLE]


def rowwise_output_dtype(out_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What a RowWise `F.scaled_mm` writes, before the cast to the model's dtype: on CUDA bf16. torch runs
    RowWise scaling on cuBLAS only on Hopper with cuBLAS 12.9+, elsewhere on its CUTLASS kernel, which
    writes bf16 alone (fp16 too in newer releases): `_scaled_mm_cuda`, "Only bf16 high precision output
    types are supported for row-wise scaling", so an fp16 or fp32 model's first RowWise GEMM on Ada or a
    B200 would fail. bf16's rounding of the output (2^-9) is far below its FP8 operands' own (2^-4). On the
    CPU (tests) the model's dtype."""
    return torch.bfloat16 if device.type == "cuda" else out_dtype


# fp32 ones [rows, 1] per device, grown to the most rows asked for: RowWise GEMMs take their row scales as a
# contiguous [M, 1] tensor (an expanded scalar is not), and a view of one buffer costs no launch per call
_UNIT_ROWS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN_ROWS: list[torch.Tensor] = []  # kept, never freed: graphs captured on them read them at replay


def unit_row_scales(rows: int, device: torch.device) -> torch.Tensor:
    """Row scales of 1 for `rows` rows: a view of the device's buffer. Never grown while a CUDA graph is being
    captured (a fill recorded in a graph runs only when it replays, so the buffer would hold no ones for the
    eager calls after it): the graph then makes its own. A buffer it outgrows stays allocated: a graph
    captured while it was the device's reads its address on every replay, and freed, that memory would go
    to other tensors (a few KB a size, sizes doubling)."""
    held = _UNIT_ROWS.get(device)
    if held is not None and held.shape[0] >= rows:
        return held[:rows]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.ones(rows, 1, dtype=torch.float32, device=device)
    size = rows
    if held is not None:
        _OUTGROWN_ROWS.append(held)
        size = max(rows, 2 * held.shape[0])
    _UNIT_ROWS[device] = torch.ones(size, 1, dtype=torch.float32, device=device)
    return _UNIT_ROWS[device][:rows]


# ---- experts -------------------------------------------------------------------------------------------
def _stack(ps: list[PackedLinear], attr: str) -> torch.Tensor:
    return torch.stack([getattr(p, attr) for p in ps])


class ScaledExperts(nn.Module):
    """A layer's routed experts on `F.scaled_grouped_mm`: slots sorted by expert (device-side offsets),
    one grouped GEMM for gate|up and one for down. `mode` as in `ScaledLinear` ("fp8" is RowWise here: the
    grouped FP8 kernel takes per-row scales, so each expert's per-tensor weight scale fills its rows). The
    output has the input's dtype (the grouped kernels compute in bf16: `scaled_experts`). `triton_rows`: the
    dispatch row's, where the probe found dgpipe's Triton kernels agreeing with the float product (FP8
    passes with at most that many rows per expert take `kernels.moe`'s GEMM; 0: torch's kernels only,
    `dispatch.EVERY_PASS`: the Triton GEMM only). `one_pass`: activations quantized by `kernels.quant`'s
    kernels (`gpu_load.one_pass`; default: where the Triton FP8 GEMM runs)."""

    graph_safe = True

    def __init__(
        self,
        gate: list[PackedLinear],
        up: list[PackedLinear],
        down: list[PackedLinear],
        mode: str,
        device: torch.device,
        triton_rows: float = 0.0,
        one_pass: bool | None = None,
    ):
        super().__init__()
        self.mode, self.num_experts = mode, len(gate)
        self.triton_rows = triton_rows if mode != "nvfp4" else 0.0
        self.one_pass = self.triton_rows > 0 if one_pass is None else one_pass
        self.combine_kernel: CombineKernel | None = None  # set by the GPU loader where probed
        self.geglu_kernel: ScaledGegluKernel | None = None  # likewise
        self.geglu_nvfp4_kernel: NvfpGegluKernel | None = None  # likewise (NVFP4 experts' down operand)
        self.order_kernel: sl.OrderKernel | None = None  # likewise
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
            # the grouped GEMM reads the activations' global scale once per expert (TensorWise, contiguous):
            # made here once, not by an expand-and-copy launch before each GEMM of every pass
            for name in ("in_scale", "down_in_scale"):
                self.register_buffer(
                    f"expert_{name}s", getattr(self, name).expand(self.num_experts).contiguous()
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

    def forward(
        self, x: torch.Tensor | sl.QuantizedRows, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        scales = (self.in_scale, self.down_in_scale)
        held = (self.expert_in_scales, self.expert_down_in_scales) if self.mode == "nvfp4" else None
        return scaled_experts(
            x, index, weights, *self._weights(), *scales, self.mode, self.triton_rows, self.one_pass,
            self.combine_kernel, self.geglu_kernel, self.order_kernel, self.geglu_nvfp4_kernel, held,
        )  # fmt: skip

    def gemms_for(self, slots: int) -> tuple:
        """Which GEMMs a pass routing `slots` (token, expert) pairs through this layer runs, as `scaled_experts`
        decides: the Triton MoE GEMM's tiles for gate|up and down, or torch's grouped GEMM. Which Triton
        binaries the pass needs follows from it (`pipeline.runtime.warm`)."""
        if kernels.moe.serves(slots, self.num_experts, self.triton_rows):
            return tuple(kernels.moe.tile_for(slots, w, 1) for w in (self.w13, self.w2))
        return ("grouped",)


def per_expert(scale: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A global scale as the grouped GEMM's TensorWise scales read it, one contiguous value per expert: as
    given where it is that already (`ScaledExperts` makes it at load), else expanded and copied."""
    return scale if scale.shape == (num_experts,) else scale.expand(num_experts).contiguous()


def in_one_pass(triton: bool, x: torch.Tensor) -> bool:
    """Whether `kernels.quant`'s kernels prepare x's operand: asked for, on CUDA, and not under torch.compile
    (which fuses the torch forms into the ops around them)."""
    return triton and x.is_cuda and not torch.compiler.is_compiling()


def blocked(
    scales: torch.Tensor, offs: torch.Tensor, one_pass: bool, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """NVFP4 block scales of rows grouped by `offs` (`scales[rows]` where `rows` is given) in the swizzled
    layout the grouped GEMM reads (`scaled_layout.to_blocked_grouped`), by `kernels.quant.blocked_scales` in
    one kernel, the gather included, where `one_pass`."""
    raw = scales.view(torch.uint8)
    if one_pass:
        return kernels.quant.blocked_scales(raw, offs, rows).view(torch.float8_e4m3fn)
    return sl.to_blocked_grouped(raw if rows is None else raw[rows], offs).view(torch.float8_e4m3fn)


def quantize_rows(
    x: torch.Tensor, in_scale: torch.Tensor, mode: str, triton: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operand of x's rows and its scales: FP8 with the static scale per row (fp8), per-row E4M3
    of the NVFP4-rounded rows (fp8_rowwise), or NVFP4 codes and their per-16 block scales (nvfp4). Each
    row is quantized on its own, so quantizing before a row gather equals quantizing the gathered rows.
    `triton`: in one pass on CUDA (`pipeline.runtime.kernels.quant`, the same codes), except under
    torch.compile, which fuses the torch form into its producer."""
    one_pass = in_one_pass(triton, x)
    if mode == "fp8":
        q = kernels.quant.fp8(x, in_scale) if one_pass else sl.fp8_quantize(x, in_scale)
        return q, in_scale.float().expand(x.shape[0])
    if mode == "fp8_rowwise":
        if one_pass:
            return kernels.quant.nvfp4_fp8_rows(x, in_scale)
        return _rowwise_dynamic(nvfp4_fake_quant(x, in_scale))
    return kernels.quant.nvfp4(x, in_scale) if one_pass else sl.nvfp4_quantize(x, in_scale)


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
    one_pass: bool = False,
    scale_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One grouped scaled GEMM: expert-sorted operand rows `q` (scales `qs`, or `qs[scale_rows]`) times `w`
    [E, N, K] packed (scales `s`, NVFP4 global scales `g`), bf16 out (the only output torch's grouped
    FP8/FP4 kernels write). `fast_accum`: FP8 accumulation mode (`FP8_FAST_ACCUM`; the benchmark times the
    other one too); `one_pass`: NVFP4 scales gathered and swizzled by `kernels.quant` in one kernel (on CUDA)."""
    scaling, _ = _api()
    weight, num_experts = w.transpose(-2, -1), w.shape[0]
    if mode == "nvfp4":
        recipe, swizzles = nvfp4_recipe()
        a_scale = blocked(qs, offs, in_one_pass(one_pass, qs), scale_rows)
        return F.scaled_grouped_mm(
            sl.as_fp4x2(q), weight, [a_scale, per_expert(in_scale, num_experts)], recipe, [s, g], recipe,
            swizzle_a=swizzles, swizzle_b=swizzles, offs=offs, output_dtype=torch.bfloat16,
        )  # fmt: skip
    qs = qs if scale_rows is None else qs[scale_rows]
    return F.scaled_grouped_mm(
        q, weight, qs.contiguous(), scaling.RowWise, s, scaling.RowWise, offs=offs, output_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )  # fmt: skip


# a fused gelu_tanh(gate) * up that can also quantize its result: (gate, up, FP8 scale or None) -> the
# product in gate's dtype, or its E4M3 codes at that scale (`pipeline.runtime.kernels.chains.geglu`)
ScaledGegluKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# the same product as NVFP4: (gate, up, global scale, scales swizzled for a linear) -> (codes packed in pairs,
# block scales) (`pipeline.runtime.kernels.chains.geglu_nvfp4`)
NvfpGegluKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]
]


def down_from_geglu(
    linear: nn.Module, kernel: ScaledGegluKernel | None, nvfp4_kernel: NvfpGegluKernel | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """A gated MLP's `linear(gelu_tanh(gate) * up)` with the down projection's operand written by the gated
    GeLU kernel: FP8 codes at the linear's input scale (`kernel`), or NVFP4 codes with their block scales
    swizzled for the linear (`nvfp4_kernel`), the same codes as the product quantized on its own, one launch
    and one [tokens, inner] pass fewer. Where `linear` is a `ScaledLinear` of that mode that quantizes in one
    pass; None where not (per-row FP8 scales each row by its maximum: the linear keeps quantizing)."""
    if not isinstance(linear, ScaledLinear):
        return None
    if linear.mode == "fp8" and kernel is not None:
        operand = lambda gate, up: (kernel(gate, up, linear.input_scale), [linear.input_scale])
    elif linear.mode == "nvfp4" and nvfp4_kernel is not None:

        def operand(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            codes, scales = nvfp4_kernel(gate, up, linear.input_scale, True)
            return codes, [scales.view(torch.float8_e4m3fn), linear.input_scale]

    else:
        return None

    def down(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not in_one_pass(linear.triton, gate):
            return linear(geglu(gate, up, kernel))
        a, scales = operand(gate, up)
        out = linear.gemm(a.reshape(-1, a.shape[-1]), scales)
        return out.reshape(*gate.shape[:-1], linear.out_features)

    return down


def down_operand(
    gate: torch.Tensor,
    up: torch.Tensor,
    scale: torch.Tensor,
    mode: str,
    one_pass: bool,
    kernel: ScaledGegluKernel | None,
    nvfp4_kernel: NvfpGegluKernel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The down projection's operand and scales: gelu_tanh(gate) * up quantized as `quantize_rows` does. With
    the fused kernels, an FP8 or NVFP4 operand in one pass (torch's form is three: the GeLU, the product,
    then the quantization) and the per-row FP8 one's product in one."""
    if kernel is not None and mode == "fp8" and in_one_pass(one_pass, gate):
        return kernel(gate, up, scale), scale.float().expand(gate.shape[0])
    if nvfp4_kernel is not None and mode == "nvfp4" and in_one_pass(one_pass, gate):
        return nvfp4_kernel(gate, up, scale, False)
    return quantize_rows(geglu(gate, up, kernel), scale, mode, one_pass)


def scaled_experts(
    x: torch.Tensor | sl.QuantizedRows,
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
    one_pass: bool = False,
    combine: CombineKernel | None = None,
    geglu_kernel: ScaledGegluKernel | None = None,
    order_kernel: sl.OrderKernel | None = None,
    geglu_nvfp4: NvfpGegluKernel | None = None,
    expert_in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A layer's routed experts: slots sorted by expert (device-side offsets, no host sync), one grouped
    scaled GEMM for gate|up and one for down, each token's top-k outputs weighted and summed. An FP8 pass
    with at most `triton_rows` slots per expert (`kernels.moe.serves`) runs both GEMMs on `kernels.moe`'s
    kernel, which gathers the token rows itself; `one_pass`: activations quantized by `kernels.quant`.

    The tokens are quantized once and their 1-byte (FP8) or half-byte (NVFP4) rows gathered top_k times,
    not gathered in bf16 and quantized top_k times over; the outputs go back to slot order with one
    permutation and each token's k rows are combined by one batched product (fp32 accumulation, no
    atomics, deterministic), not scattered with bf16 atomic adds. On an H200 at batch 16 those two
    element-wise paths took most of the experts' non-GEMM time (BENCHMARKS.md, "26B-A4B denoise pass").
    x [tokens, d] may come as the operand `quantize_rows` would make of it (`scaled_layout.QuantizedRows`).
    `expert_in_scales`: the NVFP4 GEMMs' activation global scales, one per expert (`per_expert`)."""
    routing = sl.expert_order(index, w13.shape[0], order_kernel)
    order, token_of, offs = routing.order, routing.token_of, routing.offs
    compiling = torch.compiler.is_compiling()
    in_slot_order = kernels.moe.serves(token_of.shape[0], w13.shape[0], triton_rows)
    if in_slot_order:  # the down GEMM writes each row in token-major slot order: no gather back
        small = kernels.moe.moe_gemm_op if compiling else kernels.moe.moe_gemm
        gate_up_gemm = lambda q, qs: small(q, qs, token_of, w13, s13, offs)
        down_gemm = lambda q, qs: small(q, qs, None, w2, s2, offs, out_rows=order)
    else:
        gemm = grouped_gemm_op if compiling else grouped_gemm
        gemm_in, gemm_down_in = expert_in_scales or (in_scale, down_in_scale)
        gate_up_gemm = lambda q, qs: gemm(
            q[token_of], qs, w13, s13, g13, gemm_in, offs, mode, one_pass=one_pass, scale_rows=token_of
        )
        down_gemm = lambda q, qs: gemm(q, qs, w2, s2, g2, gemm_down_in, offs, mode, one_pass=one_pass)
    if isinstance(x, sl.QuantizedRows):  # what `quantize_rows` would make of x (`gpu_load.ffn_inputs_for`)
        operand, dtype = (x.operand, *x.scales), x.dtype
    else:
        operand, dtype = quantize_rows(x, in_scale, mode, one_pass), x.dtype
    gate, up = gate_up_gemm(*operand).chunk(2, dim=-1)
    y = down_gemm(*down_operand(gate, up, down_in_scale, mode, one_pass, geglu_kernel, geglu_nvfp4))
    if in_slot_order:
        return combine_slots(y, weights, combine).to(dtype)
    return combine_top_k(y, routing, weights, combine).to(dtype)


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
    lambda q, qs, w, s, g, in_scale, offs, mode, fast_accum=FP8_FAST_ACCUM, one_pass=False, scale_rows=None: (
        q.new_empty((q.shape[0], w.shape[1]), dtype=torch.bfloat16)
    )
)
