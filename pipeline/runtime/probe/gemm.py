"""The probes of dgpipe's Triton MoE GEMM and of FP8 siblings merged into one RowWise GEMM: each against a
float reference that needs no grouped GEMM kernel, so they run where torch has none."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import DgpipeError, error_line
from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import E4M3_MAX
from pipeline.model.modelopt import PackedLinear
from pipeline.model.network import (
    combine_top_k,
    gelu_tanh,
)
from pipeline.runtime import kernels
from pipeline.runtime.dispatch import EVERY_PASS
from pipeline.runtime.kernels.moe_tiles import operand_of, tiles_source
from pipeline.runtime.probe.common import (
    TRITON_FALLBACK,
    rel_l2,
)
from pipeline.runtime.routed import routed_experts
from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear, quantize_rows


def tiny_packed(fmt: str, n: int = 128, k: int = 128, seed: int = 0) -> PackedLinear:
    """A random quantized linear in ModelOpt's stored layout, for probing."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if fmt == "fp8":
        s = w.abs().amax() / E4M3_MAX
        return PackedLinear("FP8", sl.fp8_quantize(w, s), s, None, torch.tensor(0.01))
    gs = w.abs().amax() / (6 * E4M3_MAX)
    packed, bs = sl.nvfp4_quantize(w, gs)
    return PackedLinear("NVFP4", packed, bs, gs, torch.tensor(0.01))


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


TABLE_FIX = "delete that table or tune it again: dgpipe bench moe-tiles"  # a measured tile that fails


def _check_every_tile(name: str, a, a_scale, rows, w, w_scale, offs) -> torch.Tensor:
    """The Triton GEMM at every tile it can launch with on this GPU (`kernels.moe.probe_tiles`: its default
    M tiles and this GPU's measured table) against the float product of its operands, which it returns, or a
    DgpipeError naming the tile: one bf16 rounding of the output apart; a wrong tile is O(1)."""
    want = float_gemm(a, a_scale, rows, w, w_scale, offs)
    defaults = kernels.moe.default_tiles(a.element_size())
    for tile in kernels.moe.probe_tiles(a.device, a.element_size()):
        # a tile of the GPU's measured table: the fix of its failure is that table, not the kernel
        source = "" if tile in defaults else f" of {tiles_source(a.device, operand_of(a.element_size()))}"
        try:
            err = rel_l2(kernels.moe.launch(tile, a, a_scale, rows, w, w_scale, offs), want)
        except Exception as e:
            if not source:
                raise
            raise DgpipeError(f"the {name} at {tile.short()}{source} does not run here: {error_line(e)}",
                              TABLE_FIX) from e  # fmt: skip
        if not err < 1e-2:
            hint = TABLE_FIX if source else TRITON_FALLBACK
            raise DgpipeError(f"the {name} ({tile.short()} tiles{source}) differs from the float product of its "
                              f"operands by {err:.3g} (relative L2)", hint)  # fmt: skip
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
        [tiny_packed(fmt, *shape, seed=i * p.experts + e) for e in range(p.experts)]  # distinct experts
        for i, shape in enumerate([(p.intermediate, p.hidden)] * 2 + [(p.hidden, p.intermediate)])
    )
    m = ScaledExperts(gate, up, down, mode, dev, triton_rows=EVERY_PASS)
    x, index, weights = p.routing(dev, torch.bfloat16)
    q, qs = quantize_rows(x, m.in_scale, mode)
    _, token_of, offs, _ = sl.expert_order(index, m.num_experts)
    _check_every_tile("Triton MoE GEMM", q, qs, token_of, m.w13, m.s13, offs)
    err = rel_l2(m(x, index, weights), float_experts(m, x, index, weights))
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
        ScaledLinear(tiny_packed("fp8", n, seed=i), "fp8", dev, torch.bfloat16)
        for i, n in enumerate((128, 64, 64))
    ]
    if len({p.static_scales for p in parts}) != len(parts):
        raise AssertionError("the probe's linears must differ in their weight scales")
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9)).to(dev, torch.bfloat16)
    alone = [p(x).float() for p in parts]
    merged = SharedInput(parts, concatenate(parts))(x)
    for i, (got, want) in enumerate(zip(merged, alone, strict=True)):
        err = rel_l2(got, want)
        if not err < 1e-2:
            raise DgpipeError(f"FP8 linears merged into one RowWise GEMM differ from linear {i} alone by {err:.3g} "
                              "(relative L2)", "dgpipe runs them as one GEMM each; report the GPU, torch and Triton versions")  # fmt: skip


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
    err = rel_l2(routed_experts(x, index, weights, gate_up, down, triton=True), want)
    if not err < 2e-2:  # bf16 / fp16 intermediates; a wrong kernel is O(1)
        raise DgpipeError(f"{name} experts on the Triton MoE GEMM differ from their float reference by {err:.3g} "
                          "(relative L2)", TRITON_FALLBACK)  # fmt: skip
