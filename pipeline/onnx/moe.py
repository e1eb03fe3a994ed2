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

from pipeline.model.fake_quant import E4M3_MAX, fp8_fake_quant
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
) -> torch.Tensor:
    """out[t] = sum_k weight[t, k] * down[e] @ (gelu_tanh(gate[e] @ x_t) * up[e] @ x_t), e = index[t, k];
    with `input_scale` ([3, E]) the expert inputs are FP8 fake-quantized per expert (act_quant = fp8).

    Loops over the experts that received tokens, like `Experts.forward` (no [T, K, 2I, d] gather)."""
    if x.is_meta:
        return torch.empty_like(x)
    inner = gate_up.shape[1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 sum over k (float64 stays float64: the oracle)
    out = torch.zeros(x.shape, dtype=acc)
    lin = torch.nn.functional.linear
    for e in index.unique().tolist():
        rows, slot = (index == e).nonzero(as_tuple=True)
        if input_scale is None:
            gate, up = lin(x[rows], gate_up[e]).split(inner, dim=-1)
            y = lin(gelu_tanh(gate) * up, down[e])
        else:
            gate = lin(fp8_fake_quant(x[rows], input_scale[0, e]), gate_up[e, :inner])
            up = lin(fp8_fake_quant(x[rows], input_scale[1, e]), gate_up[e, inner:])
            y = lin(fp8_fake_quant(gelu_tanh(gate) * up, input_scale[2, e]), down[e])
        out.index_add_(0, rows, y.to(acc) * weight[rows, slot, None].to(acc))
    return out.to(x.dtype)


class RoutedMoE(torch.autograd.Function):
    """Traces as one `dgpipe::MoE` node (TorchScript exporter: `symbolic`)."""

    @staticmethod
    def forward(ctx, x, index, weight, gate_up, down, top_k: int, input_scale=None):
        return routed_reference(x, index, weight, gate_up, down, input_scale)

    @staticmethod
    def symbolic(g, x, index, weight, gate_up, down, top_k: int, input_scale=None):
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
            act_quant_s="fp8" if quant else "none",
            **{f"{k}_s": v for k, v in onnx_io.PLUGIN_ATTRIBUTES.items()},
        )
        out.setType(x.type())  # same shape and dtype as the hidden states (the exporter's shape inference)
        return out


def moe_function(opset: int = onnx_io.OPSET, act_quant: str = "none") -> onnx.FunctionProto:
    """The reference body of `dgpipe::MoE` (one per model file: every MoE node of an export shares act_quant)."""
    if act_quant not in onnx_io.MOE_ACT_QUANT:
        raise ValueError(f"act_quant {act_quant!r} not in {onnx_io.MOE_ACT_QUANT}")
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
            """fp8_fake_quant(v, input_scale[row, index]) with the scale broadcast over [T, K, 1, 1]."""
            s = op("Gather", op("Gather", input_scale, const(row, np.int64), axis=0), index, axis=0)
            s = op("Unsqueeze", s, const([2, 3], np.int64))
            v32 = op("Cast", v, to=TensorProto.FLOAT)
            c = op("Clip", op("Div", v32, s), const(-E4M3_MAX, np.float32), const(E4M3_MAX, np.float32))
            q = op("Cast", op("Cast", c, to=TensorProto.FLOAT8E4M3FN, saturate=1), to=TensorProto.FLOAT)
            return op("CastLike", op("Mul", q, s), v)

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
