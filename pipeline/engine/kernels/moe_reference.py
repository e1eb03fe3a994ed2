"""The routed-experts plugin in plain PyTorch: the oracle `dg_trt_moe_*` (csrc/dg_moe.cu) is tested against.

Same inputs and output as the plugin (`pipeline.engine.moe_spec`): one row per (token, choice),
out_k[t, k] = w[t, k] * down[e] @ (gelu_tanh(gate[e] @ x_t) * (up[e] @ x_t)), e = index[t, k], computed in
`dtype` (float64 for the oracle tests) with FP8 weights dequantized by their scales and, for act_quant fp8,
the expert inputs fake-quantized per expert exactly as `pipeline.model.fake_quant.fp8_fake_quant` does.
NVFP4 weights (the `MoEExpertsW4*` plugins: packed E2M1 codes as uint8 [.., n/2], E4M3 block scales, fp32
global scales) are dequantized as the export's DequantizeLinear chain computes them, and their input_scale
is NVFP4's (the global scales of `nvfp4_fake_quant`'s dynamic per-16 block scales).
`moe_reference` adds the graph's ReduceSum over K (fp32 or wider) and the one cast to the model dtype.
A slot whose expert is outside [0, E) gets a zero row, as the kernel writes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.model.fake_quant import NVFP4_BLOCK, nvfp4_fake_quant
from pipeline.model.modelopt import unpack_e2m1

E4M3_MAX = 448.0


def _fake_fp8(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # in fp32 like the kernel and pipeline.model.fake_quant.fp8_fake_quant: (v / s) saturated to E4M3, * s
    s = scale.float()
    q = (v.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(v.dtype)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """fp32 [.., n] from codes [.., n/2] (uint8, low nibble = even element), E4M3 block scales [.., n/16] and
    global scales broadcastable to them: e2m1 * (float(block) * global), the two fp32 products of the ONNX
    DequantizeLinear chain (and of ModelOpt's dequantize) in their order, which the kernel computes too."""
    scale = block_scale.float() * global_scale.float()
    return unpack_e2m1(packed).float() * scale.repeat_interleave(NVFP4_BLOCK, dim=-1)


def moe_experts_reference(
    hidden: torch.Tensor,
    expert_index: torch.Tensor,
    expert_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    gate_up_block_scale: torch.Tensor | None = None,
    down_block_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """out_k [T, K, d] in `dtype`. FP8 weights need their scales ([E, 2, d] for gate|up, [E] for down).
    NVFP4 (given the block scales): gate_up uint8 [E, 2I, d/2] with block scales [E, 2I, d/16] and
    gate_up_scale [E, 2, d/16]; down uint8 [E, d, I/2], block scales [E, d, I/16], down_scale [E]."""
    nvfp4 = gate_up_block_scale is not None
    if nvfp4:
        if down_block_scale is None or gate_up_scale is None or down_scale is None:
            raise ValueError("NVFP4 experts need both block scales and both global scales")
        inter = gate_up.shape[1] // 2
        s = gate_up_scale.float()  # [E, 2, d/16]: row 0 for the gate rows, row 1 for the up rows
        full = torch.cat([s[:, :1].expand(-1, inter, -1), s[:, 1:].expand(-1, inter, -1)], dim=1)
        gate_up = dequantize_nvfp4(gate_up, gate_up_block_scale, full)
        down = dequantize_nvfp4(down, down_block_scale, down_scale.float()[:, None, None])
        gate_up_scale = down_scale = None
    experts, two_i, d = gate_up.shape
    inter = two_i // 2
    gu = gate_up.to(dtype)
    dn = down.to(dtype)
    fake = nvfp4_fake_quant if nvfp4 else _fake_fp8
    if gate_up_scale is not None:
        s = gate_up_scale.to(dtype)  # [E, 2, d]: row 0 scales the gate rows, row 1 the up rows
        gu = gu * torch.cat([s[:, :1].expand(-1, inter, -1), s[:, 1:].expand(-1, inter, -1)], dim=1)
    if down_scale is not None:
        dn = dn * down_scale.to(dtype)[:, None, None]
    x = hidden.to(dtype)
    tokens, k = expert_index.shape
    out = torch.zeros(tokens, k, d, dtype=dtype)
    for e in torch.unique(expert_index).tolist():
        if not 0 <= e < experts:
            continue  # zero rows
        t, j = torch.nonzero(expert_index == e, as_tuple=True)
        xe = x[t]
        if input_scale is not None:
            sc = input_scale.to(dtype)[:, e]
            g = F.linear(fake(xe, sc[0]), gu[e, :inter])
            u = F.linear(fake(xe, sc[1]), gu[e, inter:])
            h = fake(F.gelu(g, approximate="tanh") * u, sc[2])
        else:
            g, u = F.linear(xe, gu[e]).chunk(2, dim=-1)
            h = F.gelu(g, approximate="tanh") * u
        out[t, j] = F.linear(h, dn[e]) * expert_weight[t, j].to(dtype)[:, None]
    return out


def moe_reference(hidden: torch.Tensor, *args: torch.Tensor, **kw) -> torch.Tensor:
    """The `dgpipe::MoE` node's output [T, d]: the plugin's rows summed over K, cast to hidden's dtype."""
    return moe_experts_reference(hidden, *args, **kw).sum(dim=1).to(hidden.dtype)
