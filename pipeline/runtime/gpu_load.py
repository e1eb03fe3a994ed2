"""Loading onto a GPU: a quantized checkpoint's FP8 / NVFP4 weights go straight onto tensor cores as the
loader reads them (`TensorCoreLoad`, a `pipeline.model.checkpoint.PackedSink`), float experts that would read
their routing on the host route on the device (`route_float_experts`, `pipeline.runtime.routed`), the
network's element-wise chains run as one kernel each (`fuse_network`, `pipeline.runtime.kernels.chains`),
and the load reports what went where and every fallback with its reason (`Installed`; `dgpipe serve` logs
it)."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import DgpipeError
from pipeline.model.checkpoint import Checkpoint, load_model
from pipeline.model.config import ModelConfig
from pipeline.model.files import read_json, runtime_name, tensor_headers, weight_files
from pipeline.model.modelopt import PackedLinear, precision_of, quant_algo
from pipeline.model.network import DecoderLayer, DiffusionGemma, FfnInputsKernel, grouped_mm_reads_host
from pipeline.runtime.dispatch import (
    EVERY_PASS,
    NO_GROUPED_KERNEL,
    TRITON_BF16,
    TRITON_FP16,
    TRITON_MOE,
    DispatchRow,
    arch_of,
    dispatch,
)
from pipeline.runtime.kernels.chains import DTYPES as NETWORK_DTYPES
from pipeline.runtime.kernels.chains import (
    add_scaled_or_torch,
    combine,
    ffn_inputs_or_torch,
    geglu_nvfp4_or_torch,
    geglu_or_torch,
    head_norms_or_torch,
    kv_cat_or_torch,
    layer_end_or_torch,
    norm_fp8_or_torch,
    norm_nvfp4_or_torch,
    rope_or_torch,
    scale_columns_or_torch,
    softcap,
)
from pipeline.runtime.kernels.moe_tiles import expert_shapes, measured_triton_rows
from pipeline.runtime.kernels.routing import expert_order_or_torch, top_k_or_torch
from pipeline.runtime.probe import (
    COMBINE,
    EXPERT_ORDER,
    FFN_INPUTS,
    FP8_COLUMNS,
    GEGLU,
    HEAD_NORMS,
    KV_CAT,
    LAYER_END,
    NORM_FP8,
    NORM_NVFP4,
    ONE_PASS_MODES,
    RESIDUAL,
    ROPE,
    ROUTER,
    SOFTCAP,
    TOP_K,
    Probe,
    probe,
    run_forms,
)
from pipeline.runtime.routed import host_bound_experts, route_on_device
from pipeline.runtime.shared_input import SharedInput, norm_operand, share_inputs
from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear, down_from_geglu

EXPERT = re.compile(r"^(layers\.\d+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


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
    shared: int = 0  # sibling linears (q/k/v, gate/up) sharing one input quantization (`shared_input`)
    merged: int = 0  # GEMMs saved by merging siblings (gate and up; q, k and v)
    measured_rows: float | None = None  # the Triton/torch expert GEMM crossover from this GPU's tile table
    fallbacks: list[str] = field(default_factory=list)

    def summary(self) -> str:
        head = f"{self.format} on {self.arch or 'this GPU'}: {self.linears} linears and {self.experts} layers' experts on tensor cores"
        routed = [f"{self.routed} layers' float experts on {self.routed_kernel}"] if self.routed else []
        shared = [f"{self.shared} input quantizations shared by q/k/v or gate/up"] if self.shared else []
        merged = [f"siblings in one GEMM ({self.merged} GEMMs fewer)"] if self.merged else []
        rows = self.measured_rows
        tiles = (
            [f"Triton MoE GEMM up to {rows:g} rows per expert (this GPU's tile table)"]
            if rows is not None
            else []
        )
        return "; ".join([head, *routed, *shared, *merged, *tiles, *self.fallbacks])


def experts_plan(
    row: DispatchRow, pr: Probe, measured_rows: float | None = None
) -> tuple[str | None, float, str | None]:
    """How a quantized checkpoint's experts run on this GPU: (mode, Triton rows per expert, what fell back
    and why). The row's kernel if it passed its probe, else the row's second quantized path if that passed
    (`experts_fallback`), else None: dequantized to the float path. `measured_rows`: the crossover this GPU
    model's tile table measured (`moe_tiles.measured_triton_rows`), in place of the row's threshold where
    the row splits passes between the Triton GEMM and torch's."""
    exp = row.experts_mode
    if exp is None:
        return None, 0.0, None
    kernel = "experts" if row.torch_experts else "triton"  # the kernel every pass can take
    if not pr.ok(f"{kernel}:{exp}"):
        failed = f"experts: {row.experts} failed its probe ({pr.results.get(f'{kernel}:{exp}', 'not run')})"
        second = row.experts_fallback_mode
        if second and pr.ok(f"triton:{second}"):
            return second, EVERY_PASS, f"{failed}: {row.experts_fallback}"
        return None, 0.0, f"{failed}: dequantized float path"
    if row.triton and not pr.ok(f"triton:{exp}"):
        why = pr.results.get(f"triton:{exp}", "not run")
        return exp, 0.0, (f"dgpipe's Triton kernels ({TRITON_MOE}, FP8 quantization) failed their probe ({why}): "
                          "torch's grouped GEMM and quantization run every pass")  # fmt: skip
    return exp, measured_rows if row.splits_passes and measured_rows is not None else row.triton_rows, None


def one_pass(mode: str | None, pr: Probe) -> bool:
    """Whether `mode`'s activations are quantized by dgpipe's one-pass kernels (`kernels.quant`): where the
    mode's own probe passed ("quant:<mode>"), whichever GEMM reads them. Elsewhere torch's element-wise form
    (three kernels an input for FP8, ~50 for NVFP4)."""
    return mode in ONE_PASS_MODES and pr.ok(f"quant:{mode}")


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
        self.probed = pr = probed or probe(device, dtype=dtype)
        self.report = Installed(precision_of(str(quant_algo(p))).name, pr.arch)
        text = ModelConfig.from_raw(read_json(p / "config.json"), source=str(p / "config.json")).text_config
        shapes = expert_shapes(text.hidden_size, text.moe_intermediate_size)
        self.lin_mode, self.exp_mode, self.triton_rows, row = self._modes(pr, shapes)
        names = weight_files(p)

        def having(aux: str) -> set[str]:  # runtime modules whose weight has `aux` beside it
            found = (runtime_name(n.removesuffix(aux) + "weight") for n in names if n.endswith("." + aux))
            return {t.removesuffix(".weight") for t in found if t}

        # an AWQ pre_quant_scale multiplies the input first, which only the float path applies
        # (`QuantizedLoader.install`; on a routed expert it refuses the checkpoint): no tensor cores there;
        # nor for FP8 weight scales per output row, which the float path dequantizes as the CPU does
        per_row = per_row_fp8(names)
        scaled = having("input_scale") - having("pre_quant_scale") - per_row
        if per_row:
            self.report.fallbacks.append(
                f"{len(per_row)} FP8 weights with a scale per output row: dequantized float path (the "
                "tensor-core modules read ModelOpt's FP8 scale per tensor)"
            )
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

    def _modes(self, pr: Probe, shapes: tuple[tuple[int, int], ...]):
        """(linear mode, experts mode, Triton rows per expert, dispatch row) for this format on this GPU,
        after the probe; each kernel that is missing or failed its probe is reported and left to the row's
        second path or the float path. `shapes`: the experts' weight shapes, which a measured crossover
        must have timed (`measured_triton_rows`)."""
        fmt, res = self.report.format, self.report
        if pr.arch is None or fmt not in ("fp8", "nvfp4"):
            res.fallbacks.append(
                f"{fmt} on {pr.arch or 'this GPU'}: no tensor-core row; dequantized float path"
            )
            return None, None, 0.0, None
        row = dispatch(fmt, pr.arch)
        lin, exp = row.linear_mode, row.experts_mode
        if lin and not pr.ok(f"linear:{lin}"):
            res.fallbacks.append(
                f"linears: {row.linears} failed its probe ({pr.results.get(f'linear:{lin}')})"
            )
            lin = None
        measured = measured_triton_rows(self.device, shapes)
        exp, triton_rows, line = experts_plan(row, pr, measured)
        if line:
            res.fallbacks.append(line)
        if exp and measured is not None and row.splits_passes and triton_rows == measured:
            res.measured_rows = measured
        return lin, exp, triton_rows, row

    def wants(self, module: str) -> bool:
        m = EXPERT.match(module)
        return m.group(1) in self.expert_layers if m else module in self.linears

    def take(self, module: str, q: PackedLinear) -> None:
        q = q.to(self.device)
        m = EXPERT.match(module)
        if m is None:
            fast = one_pass(self.lin_mode, self.probed)
            self.modules[module] = ScaledLinear(q, self.lin_mode, self.device, self.dtype, fast)
            self.report.linears += 1
            return
        prefix = m.group(1)
        layer = self.pending.setdefault(prefix, {})
        layer.setdefault(int(m.group(2)), {})[m.group(3)] = q
        if sum(map(len, layer.values())) == self.expert_layers[prefix]:  # the layer's last projection
            per = [layer[e] for e in sorted(self.pending.pop(prefix))]
            proj = lambda name: [e[name] for e in per]
            projections = proj("gate_proj"), proj("up_proj"), proj("down_proj")
            fast = one_pass(self.exp_mode, self.probed)
            self.modules[prefix] = ScaledExperts(
                *projections, self.exp_mode, self.device, self.triton_rows, one_pass=fast
            )
            self.report.experts += 1

    def install(self, model: DiffusionGemma) -> None:
        if self.pending:
            raise DgpipeError(f"experts of {', '.join(self.pending)} incomplete in the checkpoint")
        for name, module in self.modules.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
        self.modules.clear()


def per_row_fp8(names: dict[str, Path]) -> set[str]:
    """The runtime modules whose FP8 weight has a scale per output row ([N]) in the checkpoint, from its
    files' headers. ModelOpt's FP8 export writes one scale per tensor, which the tensor-core modules read;
    the CPU load also dequantizes a scale per row (`modelopt.dequantize_weight`), and so does the float
    path these modules take on a GPU."""
    headers = tensor_headers({n: f for n, f in names.items() if n.endswith((".weight", ".weight_scale"))})
    modules: set[str] = set()
    for name, scale in headers.items():
        weight = name.removesuffix("_scale")
        if weight == name or math.prod(scale.shape) == 1 or weight not in headers:
            continue
        if headers[weight].dtype == "F8_E4M3" and (module := runtime_name(weight)):
            modules.add(module.removesuffix(".weight"))
    return modules


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
    report = finish_on_device(model, device, probed, report)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, ckpt, report


def finish_on_device(
    model: DiffusionGemma, device: torch.device, probed: Probe | None, report: Installed | None
) -> Installed | None:
    """What every load does once the weights are in (the benchmarks' random-weight loads too): float experts
    that would read the routing on the host route on the device, and on CUDA sibling linears share their
    input (`shared_input`) and the network's element-wise chains run as one kernel each where their probes
    passed (run here for those kernels alone when the load has not probed)."""
    report = route_float_experts(model, device, probed, report)
    if device.type != "cuda":
        return report
    if probed is None or ROPE not in probed.results:
        probed = probe(device, formats=())
    # q, k and v merge where the head-norms kernel will read their columns: probed, and in a dtype it takes
    columns_read = probed.ok(HEAD_NORMS) and model.embed_tokens.weight.dtype in NETWORK_DTYPES
    shared, merged = share_inputs(model, merge_qkv=columns_read, fp8_columns=probed.ok(FP8_COLUMNS))
    if report is not None:
        report.shared, report.merged = shared, merged
    return fuse_network(model, probed, report)


def ffn_inputs_for(layer: DecoderLayer) -> FfnInputsKernel:
    """The FFN-inputs kernel for `layer`, writing the dense MLP's and the experts' inputs as the FP8 or NVFP4
    operands their GEMMs read where those quantize them in one pass (`SharedInput` gate and up,
    `ScaledExperts`): the codes and scales they would make, one launch and a pass over the rows fewer each.
    Elsewhere (bf16) the rows as they are."""
    gate_up, experts = layer.mlp.gate_up_kernel, layer.experts
    first = gate_up.parts[0] if isinstance(gate_up, SharedInput) else None
    quantized = ("fp8", "nvfp4", "fp8_rowwise")
    mlp = isinstance(first, ScaledLinear) and first.mode in quantized and first.triton
    routed = isinstance(experts, ScaledExperts) and experts.mode in quantized and experts.one_pass
    if not (mlp or routed):
        return ffn_inputs_or_torch
    return functools.partial(
        ffn_inputs_or_torch,
        mlp_form=(first.mode, first.input_scale) if mlp else None,
        experts_form=(experts.mode, experts.in_scale) if routed else None,
    )


# what runs where a `kernels.chains` kernel failed its probe
TORCH_FORMS = {ROPE: "RoPE: torch's five element-wise kernels per tensor",
               SOFTCAP: "logit softcap: torch's four passes over the logits",
               COMBINE: "MoE combine: a gather back to slot order and a batched product",
               GEGLU: "gated GeLU: torch's GeLU, then the product (and the FP8 experts' quantization)",
               RESIDUAL: "residual sum and layer scale: torch's sum, then the product",
               KV_CAT: "K/V concatenation: torch.cat, one launch for K and one for V",
               ROUTER: "router input: torch's two products",
               LAYER_END: "layer end: three RMSNorms, a sum, the residual sum and scale (torch's five kernels)",
               FFN_INPUTS: "FFN inputs: a norm, the residual sum, three norms and the router's scales (torch's six kernels)",
               TOP_K: "router top-k: torch's softmax, top-k, renormalisation and scale (six kernels)",
               EXPERT_ORDER: "expert order: torch's stable sort of the routed slots, their tokens and a search for the offsets",
               HEAD_NORMS: "attention head norms: torch's q, k and v norms, then q's and k's RoPE",
               NORM_FP8: "attention input norm to FP8: torch's norm, then the FP8 quantization",
               NORM_NVFP4: "attention input norm to NVFP4: torch's norm, then the NVFP4 quantization"}  # fmt: skip


def fuse_network(model: DiffusionGemma, probed: Probe, report: Installed | None) -> Installed | None:
    """The network's element-wise chains on dgpipe's one-kernel forms (`kernels.chains`) where their probes
    passed: every layer's input norm with its FP8 or NVFP4 q|k|v operand, head norms and RoPE, K/V concatenation, gated GeLUs (dense MLP, experts, self-conditioning), router
    input and top-k, FFN inputs (the norms and residual sum after attention), experts' order and combine, the
    layer's end (its three last norms and residual sum), and the LM head's softcap; where not, the torch forms stay and
    the report says why."""
    gated = geglu_or_torch if probed.ok(GEGLU) else None
    gated_nvfp4 = geglu_nvfp4_or_torch if probed.ok(GEGLU) else None
    fp8_of_norm = norm_fp8_or_torch if probed.ok(NORM_FP8) else None
    nvfp4_of_norm = norm_nvfp4_or_torch if probed.ok(NORM_NVFP4) else None
    for layer in model.layers:
        layer.self_attn.rope_kernel = rope_or_torch if probed.ok(ROPE) else None
        layer.self_attn.kv_cat_kernel = kv_cat_or_torch if probed.ok(KV_CAT) else None
        layer.self_attn.head_norms_kernel = head_norms_or_torch if probed.ok(HEAD_NORMS) else None
        qkv = layer.self_attn.qkv_kernel
        if isinstance(qkv, SharedInput) and isinstance(qkv.parts[0], ScaledLinear):
            qkv.norm_quant = norm_operand(qkv.parts[0].mode, fp8_of_norm, nvfp4_of_norm)
        layer.mlp.geglu_kernel = gated
        layer.mlp.down_kernel = down_from_geglu(layer.mlp.down_proj, gated, gated_nvfp4)
        layer.residual_kernel = add_scaled_or_torch if probed.ok(RESIDUAL) else None
        layer.end_kernel = layer_end_or_torch if probed.ok(LAYER_END) else None
        layer.ffn_inputs_kernel = ffn_inputs_for(layer) if probed.ok(FFN_INPUTS) else None
        layer.router.scale_kernel = scale_columns_or_torch if probed.ok(ROUTER) else None
        layer.router.top_k_kernel = top_k_or_torch if probed.ok(TOP_K) else None
        if hasattr(layer.experts, "combine_kernel"):  # every experts module routed on the device
            layer.experts.combine_kernel = combine if probed.ok(COMBINE) else None
            layer.experts.geglu_kernel = gated
            if isinstance(layer.experts, ScaledExperts):
                layer.experts.geglu_nvfp4_kernel = gated_nvfp4
            layer.experts.order_kernel = expert_order_or_torch if probed.ok(EXPERT_ORDER) else None
    model.self_conditioning.geglu_kernel = gated
    model.softcap_kernel = softcap if probed.ok(SOFTCAP) else None
    for kernel, torch_form in TORCH_FORMS.items():
        if not probed.ok(kernel):
            report = report or Installed("bf16", probed.arch)
            report.fallbacks.append(f"{torch_form} (the Triton kernel failed its probe: "
                                    f"{probed.results.get(kernel, 'not run')})")  # fmt: skip
    return report


def route_float_experts(
    model: DiffusionGemma, device: torch.device, probed: Probe | None, report: Installed | None
) -> Installed | None:
    """Float experts that would read the routing on the host (`routed.host_bound_experts`) computed on the
    device instead (`routed.RoutedExperts`): on torch's `F.grouped_mm`, or where it has no kernel for the
    model's dtype on dgpipe's Triton GEMM with operands of that dtype if its probe passed (run here, for that
    form alone, where the load's probe did not: its plan follows the dispatch table, which assumes bf16). Off
    a GPU (no arch) the loaded experts stay."""
    arch = probed.arch if probed is not None else _cuda_arch(device)
    if arch is None:
        return report
    dtype = model.embed_tokens.weight.dtype
    no_kernel = grouped_kernel_missing(device, arch, dtype)
    layers = host_bound_experts(model, no_kernel)
    if not layers:
        return report
    mode = "fp16" if dtype == torch.float16 else "bf16"
    report = report or Installed(mode, arch)  # a float checkpoint: the model's dtype names it
    triton, form = TRITON_FP16 if mode == "fp16" else TRITON_BF16, f"triton:{mode}"
    if no_kernel:
        probed = probed or Probe(arch)
        if form not in probed.results:
            run_forms(probed, device, [("triton", mode, mode)], dtype)
        if not probed.ok(form):
            report.fallbacks.append(
                f"float experts: {triton} failed its probe ({probed.results[form]}): "
                "torch's per-expert loop, host sync, no CUDA graphs"
            )
            return report
    route_on_device(model, layers, triton=no_kernel)
    report.routed, report.routed_kernel = len(layers), triton if no_kernel else "F.grouped_mm bf16"
    return report


def grouped_kernel_missing(device: torch.device, arch: str, dtype: torch.dtype) -> bool:
    """Whether torch's `F.grouped_mm` has no kernel for float experts of `dtype` on this GPU: it has one for
    bf16 alone, on compute capability 9.x and 10.x alone. Asked of the device itself where it is one: a
    GPU of compute capability 11.0 shares B200's dispatch row (`arch` sm100), not torch's kernel. (Tests
    load for a GPU on the CPU: there `arch` decides.)"""
    if arch in NO_GROUPED_KERNEL or dtype != torch.bfloat16:
        return True
    return device.type == "cuda" and torch.cuda.is_available() and grouped_mm_reads_host(device, dtype)


def _cuda_arch(device: torch.device) -> str | None:
    return arch_of(*torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
