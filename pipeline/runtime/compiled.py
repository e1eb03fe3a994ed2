"""`torch.compile` for the two network passes: what a long-running server pays once to run small models
near the speed of their arithmetic.

A small model is bound by framework overhead, not FLOPs: the embedded Sudoku model's denoise pass is ~60
small ops per layer, each a dispatch and a pass through memory, so eager PyTorch spends most of a pass
between kernels. Inductor fuses the element-wise chains (norms, RoPE, GELU gating, softcap) into a few
generated C++/OpenMP (CPU) or Triton (CUDA) kernels and calls the GEMMs and attention as library kernels.

What stays the same: the weights, the runtime, the sampler (eager, already fused by hand), and the
tokens to within fp32 rounding (the fused kernels round differently in the last bits; the eager path stays
the parity path tested against transformers). What it costs: a compile on first use of each new shape
(minutes on two shared CPU cores, cached on disk by inductor for the next process) and recompiles when
the batch or context length changes; after `torch._dynamo.config.recompile_limit` shapes a pass runs
eagerly again instead of compiling forever. Hence opt-in (`--compile`), not the default: a one-shot
`dgpipe generate` would spend far longer compiling than generating.

The routed experts enter the graph as one opaque custom op (`dgpipe::routed_experts`, the eager grouped
GEMMs): torch's fake kernel for `grouped_mm` accepts bf16 only, so tracing the fp32 CPU path fails. A
quantized checkpoint on tensor cores puts only its vendor GEMM calls in the graph as opaque ops
(`dgpipe::scaled_gemm`, `dgpipe::grouped_scaled_gemm`): the activations' quantization, the routing and
the combine around them are traced and fused.
"""

from __future__ import annotations

import torch

from pipeline.model.network import DiffusionGemma, Experts, grouped_experts

COMPILED_ATTR = "_dgpipe_compiled"


def _register_routed_experts_op() -> None:
    """`dgpipe::routed_experts(x, index, weights, gate_up, down)`: the eager grouped-GEMM experts, opaque to
    the compiler (its output has x's shape and dtype; the op has no side effects)."""
    if Experts.compiled_op is not None:
        return

    @torch.library.custom_op("dgpipe::routed_experts", mutates_args=())
    def routed_experts(
        x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        return grouped_experts(x, index, weights, gate_up, down)

    @routed_experts.register_fake
    def _(x, index, weights, gate_up, down) -> torch.Tensor:
        return torch.empty_like(x)

    Experts.compiled_op = routed_experts


def compile_model(model: DiffusionGemma) -> DiffusionGemma:
    """Replace `model.denoise_soft` and `model.encode_kv` (the runtime's two passes) with compiled versions,
    in place; every runtime and backend built on `model` afterwards runs them. Idempotent. Compilation
    itself happens lazily, on each pass's first call with a new shape."""
    if getattr(model, COMPILED_ATTR, False):
        return model
    _register_routed_experts_op()
    model.denoise_soft = torch.compile(model.denoise_soft)  # type: ignore[method-assign]
    model.encode_kv = torch.compile(model.encode_kv)  # type: ignore[method-assign]
    setattr(model, COMPILED_ATTR, True)
    return model


def is_compiled(model: DiffusionGemma) -> bool:
    return bool(getattr(model, COMPILED_ATTR, False))
