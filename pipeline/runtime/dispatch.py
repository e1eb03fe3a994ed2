"""Which kernel runs each weight format on each GPU architecture, and what one denoise pass must read.

One table (`DISPATCH`): for a (format, arch) pair, the kernel for the quantized linears and for the routed
experts, the bytes per parameter that path reads, and, where no vendor kernel serves the pair, the named
fallback and what it costs. `pipeline.runtime.gpu_load` follows it on CUDA; `dgpipe doctor` prints the
rows for the local GPU; `dgpipe bench gpu` measures them; docs/engine.md writes them out.

Vendor kernels (torch, CUDA only; docs.pytorch.org/docs/stable/generated/torch.nn.functional.scaled_mm.html
and .../torch.nn.functional.scaled_grouped_mm.html):
* `F.scaled_mm` FP8 `TensorWise` / `RowWise` (cuBLASLt, sm89+); NVFP4 `[BlockWise1x16, TensorWise]`
  with `SWIZZLE_32_4_4` scales (cuBLASLt block-scaled FP4, sm100/sm120).
* `F.scaled_grouped_mm` FP8 `RowWise` (sm90 only, as torch's grouped FP8 tests gate it); NVFP4
  `[BlockWise1x16, TensorWise]` (compute capability 10.x alone, torch builds with its MSLK/FBGEMM grouped
  kernels: probed). Every torch grouped GEMM refuses other GPUs before choosing a recipe
  (`_scaled_mm_allowed_device(sm90_only, sm100_only)` in ATen's cuda/GroupedBlas.cpp: majors 9 and 10),
  so RTX Blackwell (12.x) and Thor (11.0, dispatched as sm100) have none.
* bf16: `F.linear` (cuBLAS) and `F.grouped_mm`.
Where they leave a gap, dgpipe's own Triton FP8 MoE GEMM (`pipeline.runtime.kernels.moe`): Hopper's passes
with few rows per expert, and every pass on Ada and RTX Blackwell, which have FP8 tensor cores but no grouped
GEMM kernel in torch.

Byte model of one denoise pass (the HBM floor: every byte read or written once at the pass's minimum):
weights in their stored format (experts: only those the routed slots touch, expected value under uniform
routing), the tied embedding read twice (LM head, then the soft embedding of the probabilities), the
context K/V, fp32 logits written and read once by the sampler, bf16 probabilities written and read once
by the soft embedding, every GEMM's bf16 input read and output written once (the self-conditioning MLP's
too), and attention's Q, K and V read and its output written once. Norms and element-wise ops are assumed
fused (not counted). Compute floor of the same pass: its matmul FLOPs
(`pipeline.model.cost.denoise_pass_flop_parts`) at the GPU's dense tensor-core peak, the linears' and the
experts' at the rate of the format the path reads them in, the rest at bf16's. A pass is bound by the larger
of the two floors: one canvas by memory, 16 by compute on Hopper. Config-only arithmetic, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.model.config import TextConfig
from pipeline.model.cost import denoise_pass_flop_parts
from pipeline.targets import GPU, precision, target

ARCHS = ("sm89", "sm90", "sm100", "sm120")
FORMATS = ("bf16", "fp8", "nvfp4", "int4_awq")
BF16 = 2.0


def arch_of(major: int, minor: int) -> str | None:
    """The dispatch arch of a compute capability (sm_90 -> "sm90"); None when no row covers it."""
    name = f"sm{major}{minor}"
    return {"sm103": "sm100", "sm121": "sm120", "sm110": "sm100"}.get(name, name if name in ARCHS else None)


@dataclass(frozen=True)
class DispatchRow:
    format: str  # the checkpoint's weight format
    arch: str
    linears: str  # kernel for the quantized linears (attention, dense MLP)
    experts: str  # kernel for the routed experts
    linear_read: str  # the format the linears' weights are read in on this path
    expert_read: str  # the format the experts' weights are read in on this path
    fallback: str | None = None  # named fallback when the format has no vendor kernel here
    note: str = ""
    # passes with at most this many rows per expert take dgpipe's Triton kernels, where probed (0: none;
    # EVERY_PASS: all of them, where torch has no grouped GEMM kernel for the experts' format)
    triton_rows: float = 0.0
    # where the experts' kernel fails its probe: a second quantized path tried before the dequantized float one
    experts_fallback: str | None = None
    # the `ScaledExperts` mode of that second path (the format it reads the experts' weights in)
    experts_fallback_mode: str | None = None

    def __post_init__(self) -> None:
        if (self.experts_fallback is None) != (self.experts_fallback_mode is None):
            raise ValueError(f"{self.format}/{self.arch}: experts_fallback and its mode come together")

    @property
    def native(self) -> bool:
        return self.fallback is None

    # The loaders, the probe and the benchmarks choose modules by these modes, never by the kernel names above,
    # which are display text. A mode is the format its module reads the weights in.
    @property
    def linear_mode(self) -> str | None:
        """The `ScaledLinear` mode of the quantized linears; None: float linears on torch's kernels."""
        return None if self.linear_read == "bf16" else self.linear_read

    @property
    def experts_mode(self) -> str | None:
        """The `ScaledExperts` mode of the routed experts; "bf16": float experts on dgpipe's Triton GEMM
        (`pipeline.runtime.routed`, where `triton_rows` says); None: float experts on torch's kernels."""
        if self.expert_read == "bf16":
            return "bf16" if self.triton else None
        return self.expert_read

    @property
    def triton(self) -> bool:
        """Whether some passes take dgpipe's Triton FP8 kernels."""
        return self.triton_rows > 0

    @property
    def torch_experts(self) -> bool:
        """Whether some passes' experts take torch's grouped GEMM (all but the Triton-only rows)."""
        return self.triton_rows != EVERY_PASS

    @property
    def splits_passes(self) -> bool:
        """Whether passes split between the Triton GEMM and torch's by rows per expert (Hopper): where a
        measured crossover (`kernels.moe_tiles`) may replace `triton_rows`."""
        return self.triton and self.torch_experts


def _bytes(fmt: str) -> float:
    """Bytes per weight read in `fmt` (block scales included; per-tensor/row scales are negligible)."""
    return precision(fmt).weight_bytes_per_param() if fmt != "fp8_rowwise" else 1.0


# FP8 products accumulate in the tensor cores' accumulator over the whole K loop ("fast accumulation":
# CUTLASS's *FP8FastAccum kernel schedules, cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM), not promoted into a
# second set of fp32 registers every few K blocks; torch >= 2.10's `use_fast_accum` ("Hopper-GPUs only";
# NVFP4's block-scaled kernels have no such mode). vLLM's Hopper FP8 GEMMs use it for every shape
# (csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh). Without it, torch's grouped FP8
# kernel (aten/src/ATen/native/cuda/ScaledGroupMM.cu) runs the 26B's expert shapes (256 rows per expert at
# 16 canvases) on a 128x256x64 tile carrying both accumulators, a tile size its own large-problem branch
# avoids in that mode "to avoid spilling"; it ran at 9% of the H200's FP8 rate there. The cost: Hopper keeps
# about 14 bits of the running sum (DeepSeek-V3 technical report, section 3.3.2); a model of 14-bit
# truncating accumulation (tests/_utils/accumulation.py) gives 2e-3 relative L2 at K = 2,816, against ~3%
# from the FP8 activations' own rounding. `dgpipe bench gpu` times both modes and reports their difference.
FP8_FAST_ACCUM = True
_ACC = ", fast accumulation" if FP8_FAST_ACCUM else ""
# Passes with few rows per expert (one canvas: 2,048 slots over 128 experts) take dgpipe's Triton FP8 MoE
# GEMM on Hopper (`pipeline.runtime.kernels.moe`, where the probe ran it): torch's grouped FP8 kernel streamed
# the experts' weights at 44% of an H200's HBM there. More rows per expert keep torch's kernel. Where this
# GPU model's tile table timed torch's kernel too (`dgpipe bench moe-tiles`), its measured crossover
# replaces this count (`kernels.moe_tiles.TileTable.triton_rows`, `gpu_load.experts_plan`).
TRITON_MAX_ROWS_PER_EXPERT = 64
TRITON_MOE = f"Triton FP8 MoE GEMM at <= {TRITON_MAX_ROWS_PER_EXPERT} rows per expert"
# On Ada and RTX Blackwell (sm89, sm120) torch has neither an FP8 grouped GEMM nor a bf16 one (its bf16
# `F.grouped_mm` falls back to a per-expert loop that reads the group offsets on the host), so an FP8
# checkpoint's experts take the same Triton kernel on every pass: FP8 weights (1 B/param instead of bf16's 2),
# routing kept on the device, the step capturable in a CUDA graph. Triton lowers its FP8 dot to these GPUs'
# `mma.sync` e4m3 instructions (tests/unit/runtime/kernels/test_moe.py compiles it for both). B200 (sm100)
# has torch's bf16 grouped GEMM but not its FP8 one (sm90-only), so there too the FP8 experts take the
# Triton kernel every pass rather than load dequantized at twice the bytes; Triton lowers its 64-row tile to
# Blackwell's `tcgen05.mma` FP8 instructions (compiled for sm_100a in the same test).
EVERY_PASS = math.inf
TRITON_MOE_EVERY_PASS = "Triton FP8 MoE GEMM RowWise, every pass (torch has no grouped GEMM kernel here)"
TRITON_MOE_EVERY_PASS_B200 = "Triton FP8 MoE GEMM RowWise, every pass (torch's FP8 grouped GEMM is sm90-only)"
TRITON_MOE_EVERY_PASS_REQ = "Triton FP8 MoE GEMM RowWise (weights re-quantized per row at load), every pass"
# ModelOpt's FP8 gives sibling linears (q, k, v; gate, up) one input scale and a weight scale each: one GEMM
# for them needs per-column scales (`shared_input`, where its probe ran)
SCALED_MM_FP8 = (
    "F.scaled_mm FP8 TensorWise (static input scale)"
    + _ACC
    + "; q, k, v and gate, up one F.scaled_mm RowWise each"
)
SCALED_MM_FP8_ROW = "F.scaled_mm FP8 RowWise (weights re-quantized per row at load)" + _ACC
GROUPED_FP8 = "F.scaled_grouped_mm FP8 RowWise" + _ACC + "; " + TRITON_MOE
GROUPED_FP8_REQ = (
    "F.scaled_grouped_mm FP8 RowWise (weights re-quantized per row at load)" + _ACC + "; " + TRITON_MOE
)
SCALED_MM_FP4 = "F.scaled_mm NVFP4 [BlockWise1x16, TensorWise], SWIZZLE_32_4_4"
GROUPED_FP4 = "F.scaled_grouped_mm NVFP4 [BlockWise1x16, TensorWise], SWIZZLE_32_4_4"
LINEAR_BF16 = "F.linear bf16 (dequantized at load)"
# where torch's bf16 grouped GEMM has no kernel (`pipeline.model.network.grouped_mm_reads_host`: sm89, sm120)
# and its fallback loops over the experts with the offsets on the host: float experts there take dgpipe's
# Triton MoE GEMM with bf16 operands instead (`pipeline.runtime.routed`), where probed. torch's fp16 grouped
# GEMM has no CUDA kernel on any GPU, so a model loaded with `--dtype float16` takes it with fp16 operands
# on every GPU of this table.
NO_GROUPED_KERNEL = ("sm89", "sm120")
TRITON_BF16 = "Triton bf16 MoE GEMM"
TRITON_FP16 = "Triton fp16 MoE GEMM"


def _grouped_bf16(arch: str, dequantized: bool = True) -> str:
    at_load = " (dequantized at load)" if dequantized else ""
    if arch in NO_GROUPED_KERNEL:
        return f"{TRITON_BF16}{at_load}, every pass (torch's grouped GEMM has no kernel here)"
    return f"F.grouped_mm bf16{at_load}"


def _float_triton_rows(arch: str) -> float:
    return EVERY_PASS if arch in NO_GROUPED_KERNEL else 0.0


def _rows() -> dict[tuple[str, str], DispatchRow]:
    rows = {}
    for arch in ARCHS:
        rows["bf16", arch] = DispatchRow(
            "bf16", arch, "F.linear bf16", _grouped_bf16(arch, False), "bf16", "bf16",
            triton_rows=_float_triton_rows(arch),
        )  # fmt: skip
        rows["int4_awq", arch] = DispatchRow(
            "int4_awq", arch, LINEAR_BF16, _grouped_bf16(arch), "bf16", "bf16", "bf16",
            "torch has no W4A16 grouped GEMM for the experts (its private tinygemm `_weight_int4pack_mm` is "
            "not one, nor public); the checkpoint is dequantized to bf16 (2 B/param)",
            triton_rows=_float_triton_rows(arch),
        )  # fmt: skip
    rows["fp8", "sm90"] = DispatchRow(
        "fp8", "sm90", SCALED_MM_FP8, GROUPED_FP8, "fp8", "fp8", triton_rows=TRITON_MAX_ROWS_PER_EXPERT
    )  # fmt: skip
    for arch in ("sm89", "sm120"):
        rows["fp8", arch] = DispatchRow(
            "fp8", arch, SCALED_MM_FP8, TRITON_MOE_EVERY_PASS, "fp8", "fp8", triton_rows=EVERY_PASS
        )  # fmt: skip
    # where the Triton kernel fails its probe, the experts load dequantized for torch's bf16 grouped GEMM
    # (2 B/param, inputs FP8-rounded as the checkpoint's: `gpu_load.experts_plan`)
    rows["fp8", "sm100"] = DispatchRow(
        "fp8", "sm100", SCALED_MM_FP8, TRITON_MOE_EVERY_PASS_B200, "fp8", "fp8", triton_rows=EVERY_PASS
    )  # fmt: skip
    # torch's grouped NVFP4 GEMM comes from its MSLK/FBGEMM CUTLASS kernels (`f4f4bf16_grouped_mm`); where it
    # fails its probe (a torch built without them; Thor, compute capability 11.0, which torch's grouped GEMMs
    # refuse), the experts keep FP8 (1 B/param, the 26B's ~23 GB) instead of bf16 (2 B/param, ~46 GB)
    rows["nvfp4", "sm100"] = DispatchRow(
        "nvfp4", "sm100", SCALED_MM_FP4, GROUPED_FP4, "nvfp4", "nvfp4", experts_fallback=TRITON_MOE_EVERY_PASS_REQ,
        experts_fallback_mode="fp8_rowwise",
    )  # fmt: skip
    # RTX Blackwell has FP4 tensor cores and cuBLASLt's block-scaled FP4 GEMM for the linears, but no torch
    # grouped GEMM at all: the experts take the Triton FP8 GEMM as on Ada, FP8 instead of bf16 keeping the
    # 26B's experts at ~23 GB (bf16: ~46 GB, more than an RTX 5090's 32 GB)
    rows["nvfp4", "sm120"] = DispatchRow(
        "nvfp4", "sm120", SCALED_MM_FP4, TRITON_MOE_EVERY_PASS_REQ, "nvfp4", "fp8_rowwise",
        "experts: fp8 re-quantization",
        "torch's grouped GEMMs run on compute capability 9.x and 10.x alone: the experts' dequantized NVFP4 "
        "weights re-quantized to E4M3 per output row (1 B/param) for dgpipe's Triton FP8 MoE GEMM; the linears "
        "stay NVFP4",
        triton_rows=EVERY_PASS,
    )  # fmt: skip
    rows["nvfp4", "sm90"] = DispatchRow(
        "nvfp4", "sm90", SCALED_MM_FP8_ROW, GROUPED_FP8_REQ, "fp8_rowwise", "fp8_rowwise", "fp8 re-quantization",
        "Hopper has no FP4 tensor cores: dequantized NVFP4 weights re-quantized to E4M3 per output row "
        "(1 B/param, relative error <= 2^-4 per weight); activations NVFP4-rounded, then per-row E4M3",
        triton_rows=TRITON_MAX_ROWS_PER_EXPERT,
    )  # fmt: skip
    rows["nvfp4", "sm89"] = DispatchRow(
        "nvfp4", "sm89", SCALED_MM_FP8_ROW, TRITON_MOE_EVERY_PASS_REQ, "fp8_rowwise", "fp8_rowwise", "fp8 re-quantization",
        "Ada has no FP4 tensor cores: dequantized NVFP4 weights re-quantized to E4M3 per output row "
        "(1 B/param, relative error <= 2^-4 per weight); activations NVFP4-rounded, then per-row E4M3",
        triton_rows=EVERY_PASS,
    )  # fmt: skip
    return rows


DISPATCH: dict[tuple[str, str], DispatchRow] = _rows()


def dispatch(fmt: str, arch: str) -> DispatchRow:
    return DISPATCH[fmt, arch]


# ---- byte model ----------------------------------------------------------------------------------------
def experts_touched(cfg: TextConfig, tokens: int) -> float:
    """Expected distinct experts a layer's routed slots touch (uniform routing, top-k distinct per token)."""
    e, k = cfg.num_experts, cfg.top_k_experts
    return e * (1.0 - (1.0 - k / e) ** tokens)


@dataclass(frozen=True)
class PassBytes:
    linears: float  # attention + dense MLP weights
    experts: float  # routed expert weights touched
    high_precision: float  # embedding (twice in a step), router, self-conditioning MLP: bf16 in every format
    kv: float
    logits: float  # fp32 logits + bf16 probabilities, written and read once (a pass alone: logits written)
    activations: float  # GEMM inputs and outputs, bf16

    @property
    def total(self) -> float:
        return self.linears + self.experts + self.high_precision + self.kv + self.logits + self.activations


def _linear_params(cfg: TextConfig, i: int) -> int:
    """Layer i's attention and dense-MLP weights (the quantized linears)."""
    d, s = cfg.hidden_size, cfg.layer_shape(i)
    q, kvd = cfg.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return d * q + d * kvd * (2 if s.is_sliding else 1) + q * d + 3 * d * cfg.intermediate_size


def weight_bytes(cfg: TextConfig, row: DispatchRow) -> dict[str, float]:
    """Bytes of every quantized linear and every routed expert in the formats `row` reads them: what a
    model loaded on that path holds in GPU memory for them (`pipeline.bench.gpu.trace` checks it)."""
    layers = range(cfg.num_hidden_layers)
    experts = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return {
        "linears": sum(_linear_params(cfg, i) for i in layers) * _bytes(row.linear_read),
        "experts": experts * _bytes(row.expert_read),
    }


def pass_bytes(
    cfg: TextConfig,
    linear_read: str,
    expert_read: str,
    batch: int,
    seq: int = 256,
    past: int = 0,
    step: bool = True,
) -> PassBytes:
    """Bytes one denoise step over `batch` canvases of `seq` tokens reads and writes at minimum: the
    network's pass, its sampler (fp32 logits and bf16 probabilities, each written and read) and the soft
    embedding of the probabilities for the next step (the embedding table read a second time).
    `step=False`: the network's pass alone, its fp32 logits written once (what `dgpipe bench gpu` times)."""
    d, tokens = cfg.hidden_size, batch * seq
    ring = min(past, max(cfg.sliding_window - 1, 1))
    lin = exp = kv = act = 0.0
    inner = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        s = cfg.layer_shape(i)
        q, kvd = cfg.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
        lin += _linear_params(cfg, i)
        exp += experts_touched(cfg, tokens) * 3 * d * inner
        kv += batch * (ring if s.is_sliding else past) * kvd * 2 * BF16
        kv_out = kvd * (2 if s.is_sliding else 1)  # global layers: V is K (no v_proj)
        act += tokens * BF16 * (d + q + kv_out + q + d)  # q/k/v in, outputs; o in/out
        act += tokens * BF16 * (q + 2 * kvd + q)  # attention reads Q, K and V, writes O
        act += tokens * BF16 * (d + 2 * cfg.intermediate_size + cfg.intermediate_size + d)  # dense MLP
        slots = tokens * cfg.top_k_experts
        act += slots * BF16 * (d + 2 * inner + inner + d)  # experts: gate_up in/out, down in/out
    act += (
        tokens * BF16 * (d + 2 * cfg.intermediate_size + cfg.intermediate_size + d)
    )  # self-conditioning MLP
    v = cfg.vocab_size
    tables = 2 if step else 1  # the LM head's (tied) embedding table; the soft embedding reads it again
    high = (
        tables * v * d + cfg.num_hidden_layers * d * cfg.num_experts + 3 * d * cfg.intermediate_size
    ) * BF16
    logits = tokens * v * ((4 + 4 + BF16 + BF16) if step else 4)
    return PassBytes(lin * _bytes(linear_read), exp * _bytes(expert_read), high, kv, logits, act)


def gpu_spec(product: str) -> GPU:
    """The configs/targets entry of a GPU product."""
    for name in ARCHS:
        for g in target(name).gpus:
            if g.product == product:
                return g
    raise KeyError(product)


def floor_ms(total_bytes: float, product: str) -> float:
    """Milliseconds to move `total_bytes` at the GPU's peak HBM bandwidth (configs/targets)."""
    return total_bytes / (gpu_spec(product).bandwidth_tb_s * 1e12) * 1e3


# the tensor-core rate a GEMM runs at, by the format its weights are read in (FP8 re-quantized rows: FP8)
RATE_OF = {"bf16": "bf16", "fp8": "fp8", "fp8_rowwise": "fp8", "nvfp4": "nvfp4"}


def compute_ms(
    cfg: TextConfig,
    row: DispatchRow,
    batch: int,
    product: str,
    seq: int = 256,
    past: int = 0,
    step: bool = True,
) -> float | None:
    """Milliseconds for one pass's matmuls on `row`'s path at the GPU's dense tensor-core peak
    (configs/targets), or None where a rate it needs is not recorded: the linears and the experts at the rate
    of the formats they are read in, everything else (attention, router, self-conditioning, LM head, soft
    embedding) at bf16's. `step=False`: without the soft embedding (as `pass_bytes`)."""
    f, rates = denoise_pass_flop_parts(cfg, batch, seq, past, step=step), gpu_spec(product).dense_tflops
    parts = ((f.linears, RATE_OF[row.linear_read]), (f.experts, RATE_OF[row.expert_read]), (f.other, "bf16"))
    if any(rate not in rates for _, rate in parts):
        return None
    return sum(flops / (rates[rate] * 1e12) for flops, rate in parts) * 1e3


FLOOR_GPUS = (
    ("sm90", "H100-SXM5-80GB"),
    ("sm90", "H200-SXM-141GB"),
    ("sm100", "B200-180GB"),
    ("sm120", "RTX-PRO-6000-Blackwell"),
)


@dataclass(frozen=True)
class FloorRow:
    gpu: str
    format: str
    batch: int
    kernel: str  # linears / experts
    path_gb: float  # what the dispatched path reads
    floor_gb: float  # what the format's own stored weights would read
    path_ms: float
    floor_ms: float
    compute_ms: float | None = None  # the path's matmuls at the dense tensor-core peak (None: rate unknown)

    @property
    def ratio(self) -> float:
        return self.path_gb / self.floor_gb

    @property
    def bound(self) -> str:
        """What bounds the path's pass at the GPU's peaks: "memory", "compute", or "—" (no compute rate)."""
        if self.compute_ms is None:
            return "—"
        return "compute" if self.compute_ms > self.path_ms else "memory"


def floor_table(
    cfg: TextConfig, batches: tuple[int, ...] = (1, 16), seq: int = 256, past: int = 0
) -> list[FloorRow]:
    """Per GPU, format and batch: the dispatched path's bytes and time at peak bandwidth against the floor
    of the format itself (weights read as stored), and the path's matmuls at peak tensor-core rate."""
    out = []
    for arch, gpu in FLOOR_GPUS:
        for fmt in ("bf16", "fp8", "nvfp4"):
            row = dispatch(fmt, arch)
            for b in batches:
                path = pass_bytes(cfg, row.linear_read, row.expert_read, b, seq, past).total
                own = pass_bytes(cfg, fmt, fmt, b, seq, past).total
                out.append(
                    FloorRow(
                        gpu, fmt, b, f"{row.linears} / {row.experts}", path / 1e9, own / 1e9,
                        floor_ms(path, gpu), floor_ms(own, gpu), compute_ms(cfg, row, b, gpu, seq, past),
                    )
                )  # fmt: skip
    return out


def render_floor_table(rows: list[FloorRow]) -> str:
    """Markdown: one line per (GPU, format, batch)."""
    lines = [
        "| GPU | format | batch | path reads (GB) | floor (GB) | path at peak HBM (ms) | floor (ms) | path / floor "
        "| path's matmuls at peak tensor-core rate (ms) | bound by |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        compute = "—" if r.compute_ms is None else f"{r.compute_ms:.2f}"
        lines.append(
            f"| {r.gpu} | {r.format} | {r.batch} | {r.path_gb:.1f} | {r.floor_gb:.1f} | {r.path_ms:.2f} "
            f"| {r.floor_ms:.2f} | {r.ratio:.2f}x | {compute} | {r.bound} |"
        )
    return "\n".join(lines)


def render_dispatch(arch: str | None = None) -> str:
    """Markdown: the dispatch rows (all, or one arch's)."""
    lines = ["| format | arch | linears | experts | fallback |", "|---|---|---|---|---|"]
    for (fmt, a), r in DISPATCH.items():
        if arch is None or a == arch:
            experts = r.experts + (
                f"; where it fails its probe: {r.experts_fallback}" if r.experts_fallback else ""
            )
            lines.append(
                f"| {fmt} | {a} | {r.linears} | {experts} | {r.fallback or '—'}{': ' + r.note if r.note else ''} |"
            )
    return "\n".join(lines)
