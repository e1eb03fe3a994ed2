"""Which of the dispatch table's kernels this GPU and torch build run. Each GEMM form the table names for the
GPU's architecture runs once on tiny operands at load (`probe`); dgpipe's own Triton kernels must also agree
with a reference that needs no vendor kernel: the MoE GEMM and merged FP8 siblings with float products
(`gemm`), the one-pass activation quantizations with torch's forms (`quant`), the network's one-kernel
chains (`chains`), its kernels around RMSNorms (`norms`) and its routing (`routing`) with the torch forms
they replace. What fails takes the row's fallback (`pipeline.runtime.gpu_load`), so a kernel that a host's
driver, torch or Triton build cannot run costs speed, never a wrong answer or a crash while serving."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.errors import DgpipeError, error_line
from pipeline.runtime.dispatch import arch_of, dispatch
from pipeline.runtime.kernels.moe_tiles import TileTableError
from pipeline.runtime.probe.chains import (
    check_triton_combine,
    check_triton_geglu,
    check_triton_kv_cat,
    check_triton_residual,
    check_triton_rope,
    check_triton_router,
    check_triton_softcap,
)
from pipeline.runtime.probe.gemm import (
    FLOAT_OPERANDS,
    check_fp8_columns,
    check_triton_float,
    check_triton_fp8,
    tiny_packed,
)
from pipeline.runtime.probe.norms import (
    check_triton_ffn_inputs,
    check_triton_head_norms,
    check_triton_layer_end,
    check_triton_norm_fp8,
    check_triton_norm_nvfp4,
)
from pipeline.runtime.probe.quant import check_triton_quant
from pipeline.runtime.probe.routing import check_triton_expert_order, check_triton_top_k
from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear


@dataclass
class Probe:
    """What this GPU and torch build run: kernel name -> None (ran) or the error it raised."""

    arch: str | None
    results: dict[str, str | None] = field(default_factory=dict)

    def ok(self, kernel: str) -> bool:
        return kernel in self.results and self.results[kernel] is None


PROBED_FORMATS = ("fp8", "nvfp4", "bf16", "int4_awq")
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
        uses = (("linear", row.linear_mode, True), ("experts", row.experts_mode, row.torch_experts),
                ("triton", row.experts_mode, row.triton), ("triton", row.experts_fallback_mode, True))  # fmt: skip
        for kind, row_mode, used in uses:
            mode = row_mode if used else None
            # activations' one-pass quantization is a kernel of its own, whichever GEMM reads them
            for k in (kind, "quant") if mode in ONE_PASS_MODES else (kind,):
                form = (k, mode, {"fp8": "fp8", "bf16": "bf16"}.get(mode or "", "nvfp4"))
                if mode and form not in plan:
                    plan.append(form)
        if row.linear_mode == "fp8" and FP8_COLUMNS_FORM not in plan:
            plan.append(FP8_COLUMNS_FORM)
    return [*plan, *NETWORK_FORMS]


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
                ScaledLinear(tiny_packed(fmt), mode, dev, dtype)(x)
            elif kind == "experts":
                ps = [tiny_packed(fmt) for _ in range(4)]
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
        except TileTableError:  # a tile table that cannot be read is the load's error, not a slower path
            raise
        except Exception as e:  # any failure (a Triton compile error included) sends the form to its fallback
            p.results[name] = error_line(e)
    return p
