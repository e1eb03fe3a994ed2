"""Float experts on CUDA with the routing kept on the device, where `pipeline.model.network.Experts` as loaded
would not keep it there.

Two cases leave a layer's experts in float on a GPU:
* a bf16 checkpoint (or an INT4-AWQ one, dequantized) on Ada or RTX Blackwell (sm89, sm120), or any model
  loaded in fp16, where torch's `F.grouped_mm` has no kernel and falls back to a per-expert loop that reads
  the group offsets on the host (`network.grouped_mm_reads_host`);
* an FP8 / NVFP4 checkpoint whose experts the dispatch table or the probe leaves dequantized (FP8 on B200:
  torch's FP8 grouped GEMM is sm90-only). The loader then installs the CPU path's fake-quantized expert loop
  (`pipeline.model.modelopt`), which reads the routing counts on the host and runs one GEMM per expert.

Either way every denoise step syncs with the host and no CUDA graph can capture it. `RoutedExperts` computes
the same thing with the routing on the device: the slots sorted by expert (`scaled_layout.expert_order`),
one grouped GEMM per projection (torch's `F.grouped_mm` where it has a kernel, dgpipe's Triton MoE GEMM,
`kernels.moe.moe_gemm`, where it has none), each token's k rows combined by one batched product
(`network.combine_top_k`). A quantized checkpoint's inputs are rounded by the same `InputQuantizer`s as
the loop's, once per token before the row gather (a static scale per tensor: rounding then gathering is
gathering then rounding). The CPU path, and the loop as the tests' oracle, are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.network import (
    CombineKernel,
    DiffusionGemma,
    Experts,
    GegluKernel,
    combine_slots,
    combine_top_k,
    geglu,
)
from pipeline.model.scaled_layout import OrderKernel, expert_order
from pipeline.runtime import kernels

Quantizer = Callable[[torch.Tensor], torch.Tensor]


def routed_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    triton: bool,
    q_in: Quantizer | None = None,
    q_down: Quantizer | None = None,
    combine: CombineKernel | None = None,
    geglu_kernel: GegluKernel | None = None,
    order_kernel: OrderKernel | None = None,
) -> torch.Tensor:
    """A layer's float experts ([E, 2I, d] gate|up, [E, d, I] down, bf16 or fp16) on grouped GEMMs, the
    inputs of each projection rounded by `q_in` / `q_down` first (a quantized checkpoint's activation
    formats)."""
    routing = expert_order(index, gate_up.shape[0], order_kernel)
    order, token_of, offs = routing.order, routing.token_of, routing.offs
    if triton:  # the token rows gathered inside the kernel, the down rows written in token-major slot order
        op = kernels.moe.moe_gemm_op if torch.compiler.is_compiling() else kernels.moe.moe_gemm
        gemm = lambda a, rows, w, out_rows=None: op(a, None, rows, w, None, offs, out_rows=out_rows)
    else:
        gemm = lambda a, rows, w, out_rows=None: F.grouped_mm(
            a if rows is None else a[rows], w.transpose(-2, -1), offs=offs
        )
    gate, up = gemm(q_in(x) if q_in is not None else x, token_of, gate_up).chunk(2, dim=-1)
    h = geglu(gate, up, geglu_kernel)
    y = gemm((q_down(h) if q_down is not None else h).to(down.dtype), None, down, order if triton else None)
    if triton:
        return combine_slots(y, weights, combine).to(x.dtype)
    return combine_top_k(y, routing, weights, combine).to(x.dtype)


class RoutedExperts(nn.Module):
    """`routed_experts` in place of a layer's `Experts`, sharing its parameters (same names, no copy).
    `triton`: dgpipe's Triton GEMM (no `F.grouped_mm` kernel on this GPU); `quantizers`: the loader's
    activation rounding for the "gate_up" and "down" inputs of a quantized checkpoint's dequantized experts."""

    graph_safe = True

    def __init__(
        self, experts: Experts, triton: bool, quantizers: dict[str, Quantizer] | None = None
    ) -> None:
        super().__init__()
        self.num_experts, self.triton = experts.num_experts, triton
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.q_in, self.q_down = (quantizers or {}).get("gate_up"), (quantizers or {}).get("down")
        self.combine_kernel: CombineKernel | None = None  # set by the GPU loader where probed
        self.geglu_kernel: GegluKernel | None = None  # likewise
        self.order_kernel: OrderKernel | None = None  # likewise

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return routed_experts(
            x, index, weights, self.gate_up_proj, self.down_proj, self.triton, self.q_in, self.q_down,
            self.combine_kernel, self.geglu_kernel, self.order_kernel,
        )  # fmt: skip

    def gemms_for(self, slots: int) -> tuple:
        """Which GEMMs a pass routing `slots` (token, expert) pairs through this layer runs: the Triton MoE
        GEMM's tiles for gate|up and down, or torch's grouped GEMM (`pipeline.runtime.warm`)."""
        if self.triton:
            size = self.gate_up_proj.element_size()
            return tuple(kernels.moe.tile_for(slots, w, size) for w in (self.gate_up_proj, self.down_proj))
        return ("grouped",)


def host_bound_experts(model: DiffusionGemma, no_grouped_kernel: bool) -> list[int]:
    """The layers whose experts, as loaded, would read the routing on the host on a GPU: a quantized
    checkpoint's fake-quantized expert loop anywhere, plain bf16 or fp16 experts where torch's grouped GEMM
    has no kernel for their dtype (`no_grouped_kernel`: sm89 and sm120 for bf16, every GPU for fp16).
    Experts on tensor cores (`tensor_cores.ScaledExperts`) are not float."""
    layers = []
    for i, layer in enumerate(model.layers):
        experts = layer.experts
        if not isinstance(experts, Experts) or experts.gate_up_proj.dtype not in kernels.moe.FLOAT_OPERANDS:
            continue  # tensor-core experts; or fp32, which takes the dense form on CUDA (no host read)
        like = torch.empty(0, dtype=experts.gate_up_proj.dtype, device=experts.gate_up_proj.device)
        if not no_grouped_kernel and not experts.use_grouped(like):
            continue  # sizes torch's grouped GEMM cannot take (not 16-byte aligned): left as loaded
        loop = vars(experts).get("forward")  # the loader's fake-quantized loop, replaced on the instance
        if loop is not None and getattr(loop, "input_quantizers", None) is None:
            continue  # a forward this module does not know how to reproduce: left as loaded
        if loop is not None or no_grouped_kernel:
            layers.append(i)
    return layers


def route_on_device(model: DiffusionGemma, layers: list[int], triton: bool) -> None:
    """Put `RoutedExperts` in place of those layers' experts, with the loop's activation rounding, if any."""
    for i in layers:
        experts = model.layers[i].experts
        quantizers = getattr(vars(experts).get("forward"), "input_quantizers", None)
        model.layers[i].experts = RoutedExperts(experts, triton, quantizers)
