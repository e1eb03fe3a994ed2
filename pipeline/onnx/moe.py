"""The routed `dgpipe::MoE` node: how the traced graph emits it, and its ONNX reference function.

The contract (inputs, outputs, attributes, quantized inputs) is `pipeline.onnx.contract.MOE`. Two pieces:
  * `RoutedMoE`, a `torch.autograd.Function` whose `symbolic` writes ONE `dgpipe::MoE` node per decoder
    layer when the TorchScript exporter traces `pipeline.onnx.graph.GraphModel` with `moe="routed"`. Its
    forward computes the same maths in PyTorch (`pipeline.model.network.Experts.forward`, the oracle) so the
    trace has real values, and returns an empty tensor of the right shape on the meta device (the
    streaming exporter traces without weights).
  * `moe_function`, the model-local FunctionProto of the same domain/name, built from standard ops, which
    onnxruntime executes (TensorRT maps the node to the grouped-GEMM plugin instead). It computes only the
    selected experts: Gather of each (token, k)'s expert weights, then a batched MatMul - 2 * T * K * 3 * d * I
    FLOPs, top_k / E of the dense form. It materialises the gathered weights ([T, K, 2I, d]), which is
    fine for a CPU reference on small models and is exactly why the engine uses a plugin.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from pipeline.model.fake_quant import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK, fp8_fake_quant, nvfp4_fake_quant
from pipeline.model.network import gelu_tanh
from pipeline.onnx import contract as onnx_io

MOE_INPUTS = [s.name for s in onnx_io.MOE.inputs]


def routed_reference(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    act_quant: str = "fp8",
) -> torch.Tensor:
    """out[t] = sum_k weight[t, k] * down[e] @ (gelu_tanh(gate[e] @ x_t) * up[e] @ x_t), e = index[t, k];
    with `input_scale` ([3, E]) the expert inputs are fake-quantized per expert in `act_quant` (fp8: per
    tensor; nvfp4: input_scale is the global scale of the dynamic per-16 E4M3 block scales).

    Loops over the experts that received tokens, like `Experts.forward` (no [T, K, 2I, d] gather)."""
    if x.is_meta:
        return torch.empty_like(x)
    inner = gate_up.shape[1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 sum over k (float64 stays float64: the oracle)
    out = torch.zeros(x.shape, dtype=acc)
    lin = torch.nn.functional.linear
    fq = {"fp8": fp8_fake_quant, "nvfp4": nvfp4_fake_quant}[act_quant] if input_scale is not None else None
    for e in index.unique().tolist():
        rows, slot = (index == e).nonzero(as_tuple=True)
        if input_scale is None:
            gate, up = lin(x[rows], gate_up[e]).split(inner, dim=-1)
            y = lin(gelu_tanh(gate) * up, down[e])
        else:
            gate = lin(fq(x[rows], input_scale[0, e]), gate_up[e, :inner])
            up = lin(fq(x[rows], input_scale[1, e]), gate_up[e, inner:])
            y = lin(fq(gelu_tanh(gate) * up, input_scale[2, e]), down[e])
        out.index_add_(0, rows, y.to(acc) * weight[rows, slot, None].to(acc))
    return out.to(x.dtype)


class RoutedMoE(torch.autograd.Function):
    """Traces as one `dgpipe::MoE` node (TorchScript exporter: `symbolic`)."""

    @staticmethod
    def forward(ctx, x, index, weight, gate_up, down, top_k: int, input_scale=None, act: int = 1):
        """`act`: act_quant as its index in MOE_ACT_QUANT (a scalar argument of the traced op)."""
        # the node is traced as one op (symbolic), so its value is computed with tracing off: traced,
        # nvfp4_fake_quant made torch.onnx.export (TorchScript, torch 2.13) fail with "unordered_map::at"
        state = torch._C._get_tracing_state()
        torch._C._set_tracing_state(None)
        try:
            return routed_reference(x, index, weight, gate_up, down, input_scale, onnx_io.MOE_ACT_QUANT[act])
        finally:
            torch._C._set_tracing_state(state)

    @staticmethod
    def symbolic(g, x, index, weight, gate_up, down, top_k: int, input_scale=None, act: int = 1):
        shape = gate_up.type().sizes()  # an initializer: its shape is static
        quant = input_scale is not None and not input_scale.node().mustBeNone()
        out = g.op(
            f"{onnx_io.DOMAIN}::{onnx_io.MOE.name}",
            x,
            index,
            weight,
            gate_up,
            down,
            *([input_scale] if quant else []),
            num_experts_i=shape[0],
            top_k_i=top_k,
            expert_hidden_i=shape[1] // 2,
            activation_s="gelu_tanh",
            act_quant_s=onnx_io.MOE_ACT_QUANT[act] if quant else "none",
            **{f"{k}_s": v for k, v in onnx_io.PLUGIN_ATTRIBUTES.items()},
        )
        out.setType(x.type())  # same shape and dtype as the hidden states (the exporter's shape inference)
        return out


def moe_function(opset: int = onnx_io.OPSET, act_quant: str = "none") -> onnx.FunctionProto:
    """The reference body of `dgpipe::MoE` (one per model file: every MoE node of an export shares act_quant)."""
    if act_quant not in onnx_io.MOE_ACT_QUANT:
        raise ValueError(f"act_quant {act_quant!r} not in {onnx_io.MOE_ACT_QUANT}")
    if act_quant == "nvfp4" and opset < onnx_io.OPSET_NVFP4:
        raise ValueError(f"act_quant nvfp4 casts to FLOAT4E2M1: opset >= {onnx_io.OPSET_NVFP4}, not {opset}")
    nodes: list[onnx.NodeProto] = []
    n = 0

    def op(op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        nonlocal n
        n += 1
        name = out or f"moe_{op_type.lower()}_{n}"
        nodes.append(helper.make_node(op_type, list(inputs), [name], **attrs))
        return name

    def const(value, dtype) -> str:
        nonlocal n
        n += 1
        name = f"moe_c{n}"
        arr = np.asarray(value, dtype=dtype)
        nodes.append(helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(arr)))
        return name

    x, index, weight, gate_up, down, input_scale = MOE_INPUTS
    xc = op("Unsqueeze", x, const([1, 3], np.int64))  # [T, 1, d, 1]
    gu = op("Gather", gate_up, index, axis=0)  # [T, K, 2I, d]: only the selected experts' weights
    if act_quant == "none":
        h = op("MatMul", gu, xc)  # [T, K, 2I, 1]
        g, u = f"moe_gate_{n}", f"moe_up_{n}"
        nodes.append(helper.make_node("Split", [h], [g, u], axis=2, num_outputs=2))
    else:  # gate and up see x fake-quantized with their own per-expert scale
        gw, uw = "moe_gate_w", "moe_up_w"
        nodes.append(helper.make_node("Split", [gu], [gw, uw], axis=2, num_outputs=2))

        def fake_quant(v: str, row: int) -> str:
            """The act_quant fake quant of v ([T, K or 1, n, 1]) with its expert's input_scale[row, index]
            broadcast over [T, K, 1, 1]: fp8_fake_quant / nvfp4_fake_quant (pipeline.model.fake_quant)."""
            s = op("Gather", op("Gather", input_scale, const(row, np.int64), axis=0), index, axis=0)
            s = op("Unsqueeze", s, const([2, 3], np.int64))
            v32 = op("Cast", v, to=TensorProto.FLOAT)
            if act_quant == "nvfp4":
                return op("CastLike", nvfp4(v32, s), v)
            c = op("Clip", op("Div", v32, s), const(-E4M3_MAX, np.float32), const(E4M3_MAX, np.float32))
            q = op("Cast", op("Cast", c, to=TensorProto.FLOAT8E4M3FN, saturate=1), to=TensorProto.FLOAT)
            return op("CastLike", op("Mul", q, s), v)

        def nvfp4(v32: str, gs: str) -> str:
            """Blocks of 16 along n: s = e4m3(min(amax / (6 gs), 448)) * gs (1 where < 1e-5), then
            e2m1(v / s) * s - the same operations, in the same order, as nvfp4_fake_quant."""
            f32 = np.float32
            gs = op("Where", op("Greater", gs, const(0, f32)), gs, const(1e-12, f32))
            blocks = op("Reshape", v32, const([0, 0, -1, NVFP4_BLOCK], np.int64))  # [T, K|1, n/16, 16]
            amax = op("ReduceMax", op("Abs", blocks), const([3], np.int64), keepdims=1)
            bs = op("Min", op("Div", amax, op("Mul", const(E2M1_MAX, f32), gs)), const(E4M3_MAX, f32))
            bs = op("Cast", op("Cast", bs, to=TensorProto.FLOAT8E4M3FN, saturate=1), to=TensorProto.FLOAT)
            bs = op("Mul", bs, gs)
            bs = op("Where", op("GreaterOrEqual", bs, const(1e-5, f32)), bs, const(1.0, f32))
            c = op("Clip", op("Div", blocks, bs), const(-E2M1_MAX, f32), const(E2M1_MAX, f32))
            q = op("Cast", op("Cast", c, to=TensorProto.FLOAT4E2M1), to=TensorProto.FLOAT)
            return op("Reshape", op("Mul", q, bs), const([0, 0, -1, 1], np.int64))  # [T, K, n, 1]

        g = op("MatMul", gw, fake_quant(xc, 0))
        u = op("MatMul", uw, fake_quant(xc, 1))
    a = op("Mul", op("Gelu", g, approximate="tanh"), u)  # [T, K, I, 1]
    if act_quant != "none":
        a = fake_quant(a, 2)
    y = op("MatMul", op("Gather", down, index, axis=0), a)  # [T, K, d, I] @ [T, K, I, 1] -> [T, K, d, 1]
    w = op("Unsqueeze", op("Cast", weight, to=TensorProto.FLOAT), const([2, 3], np.int64))
    s = op("ReduceSum", op("Mul", op("Cast", y, to=TensorProto.FLOAT), w), const([1], np.int64), keepdims=0)
    op("CastLike", op("Squeeze", s, const([2], np.int64)), x, out="out")
    inputs = MOE_INPUTS if act_quant != "none" else MOE_INPUTS[:-1]
    return helper.make_function(
        onnx_io.DOMAIN,
        onnx_io.MOE.name,
        inputs,
        [s.name for s in onnx_io.MOE.outputs],
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[*onnx_io.MOE.attributes, *onnx_io.PLUGIN_ATTRIBUTES],
    )
