"""`torch.compile` for the network's decoder layers: what a long-running server pays once to run small
models near the speed of their arithmetic.

A small model is bound by framework overhead, not FLOPs: the embedded Sudoku model's denoise pass is ~60
small ops per layer, each a dispatch and a pass through memory, so eager PyTorch spends most of a pass
between kernels. Inductor fuses the element-wise chains (norms, RoPE, GELU gating, quantization) into a
few generated C++/OpenMP (CPU) or Triton (CUDA) kernels and calls the GEMMs and attention as library
kernels.

Regional compilation: each decoder layer is compiled, not the whole pass. The layers run the same code on
weights of the same shapes, so one compiled graph per layer kind (sliding, global) and pass serves all of
them; compiling the whole pass instead traces and lowers every layer again (the 26B has 30). On this
repository's CI machine a 30-layer model with the 26B's layer pattern took 49 s to compile its denoise
pass whole and 8 s by layer; on an H200 the whole 26B FP8 pass did not finish compiling within 135 s.
Each kind, pass (causal or denoise), mask presence and shape is its own graph, hence a recompile limit
raised to `RECOMPILE_LIMIT` for that code.

What stays the same: the weights, the runtime, the sampler (eager, already fused by hand), the LM head
(in-place, chunked), and the tokens to within rounding (the eager path stays the parity path tested
against transformers). Fused kernels round differently in the last bits; in bf16 inductor also keeps the
intermediates of a fused chain in fp32 instead of rounding each to bf16, so an FP8 model's activation
codes move where a value sits on a rounding boundary (a tiny random FP8 model's logits: 22% relative L2
from eager, 4.8% with `torch._inductor.config.emulate_precision_casts`: tests/unit/runtime/test_compiled.py).

What it costs: a compile on first use of each new shape (cached on disk by inductor for the next process).
Hence opt-in (`--compile`), not the default: a one-shot `dgpipe generate` would spend far longer compiling
than generating.

bf16 routed experts (Hopper, B200) are traced: torch's grouped GEMMs, with the routing, gated GeLU and
combine around them for inductor to fuse (the hand-fused kernels stay out of compilers). Other dtypes enter
the graph as one opaque custom op (`dgpipe::routed_experts`, the eager grouped GEMMs): torch's fake kernel
for `grouped_mm` accepts bf16 only, so tracing the fp32 CPU path fails. A
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


RECOMPILE_LIMIT = 64  # graphs per compiled function: 2 layer kinds x 2 passes x mask or none x shapes


def compile_model(model: DiffusionGemma, dynamic: bool | None = None) -> DiffusionGemma:
    """Compile each decoder layer in place (`nn.Module.compile`); every runtime and backend built on `model`
    afterwards runs them. Idempotent. Compilation itself happens lazily, on a layer kind's first call with a
    new shape. `dynamic`: torch.compile's (False: one static graph per shape, as a benchmark measures)."""
    if getattr(model, COMPILED_ATTR, False):
        return model
    _register_routed_experts_op()
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.7's name
    setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    for layer in model.layers:
        layer.compile(dynamic=dynamic)
    setattr(model, COMPILED_ATTR, True)
    return model


def is_compiled(model: DiffusionGemma) -> bool:
    return bool(getattr(model, COMPILED_ATTR, False))
