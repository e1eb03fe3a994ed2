"""Lower each exported `dgpipe::MoE` node to what TensorRT runs: an expert plugin + ReduceSum + CastLike.

Why not a `dgpipe::MoE` plugin as is: an AOT plugin is one kernel launch (docs/engine.md), and one launch
cannot compute every routed (token, expert) pair AND sum a token's K results without atomics or a second
pass. So the plugin writes one fp32 row per (token, choice), out_k [T, K, d], and two standard layers
finish the node exactly as the ONNX contract defines it (pipeline/onnx/contract.py MOE: "summed over k in
fp32, cast to the model dtype once"):

    MoE(hidden, index, weight, gate_up, down[, input_scale])
      -> MoEExperts*(...) -> out_k [T, K, d] fp32 -> ReduceSum(axis 1) -> CastLike(hidden) -> out [T, d]

Weight formats (moe_spec): model-dtype weights feed `MoEExperts`. FP8 weights arrive as
FLOAT8E4M3FN initializer -> DequantizeLinear (the contract's quantized form); the lowering feeds the packed
initializer and its scale (cast to fp32) straight to `MoEExpertsW8` (`W8A8` when act_quant = fp8, with
input_scale), so the engine keeps 1-byte expert weights and the DequantizeLinear nodes go away. Anything
else - NVFP4 expert weights, an unknown activation - is refused with what to do instead.
"""

from __future__ import annotations

from typing import Any

from pipeline.engine import moe_spec
from pipeline.engine.plugin_spec import NAMESPACE
from pipeline.errors import DgpipeError

_PASS_THROUGH = ("Cast", "Identity")  # between a DequantizeLinear and the node's weight input


def _attr(node: Any, name: str, default: str) -> str:
    for a in node.attribute:
        if a.name == name:
            return a.s.decode() if a.s else default
    return default


def _fp8_source(
    name: str, producers: dict[str, Any], inits: dict[str, Any]
) -> tuple[str, str, list[str]] | None:
    """(FP8 initializer, its scale, the outputs of the chain's nodes) behind weight input `name`, or None
    when the weight is not dequantized (model dtype). Refuses other packed formats (NVFP4, INT4)."""
    from onnx import TensorProto

    chain, node = [], producers.get(name)
    while node is not None and node.op_type in _PASS_THROUGH:
        chain.append(node.output[0])
        node = producers.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear":
        return None
    packed = inits.get(node.input[0])
    kind = TensorProto.DataType.Name(packed.data_type) if packed is not None else "a computed tensor"
    if packed is None or packed.data_type != TensorProto.FLOAT8E4M3FN:
        raise DgpipeError(
            f"the MoE weight {name!r} is dequantized from {kind}: the MoE plugin has FP8 E4M3 and "
            "model-dtype kernels only (NVFP4 expert weights: not yet)",
            hint="build with --precision fp8 or bf16, or export with --moe dense",
        )
    return node.input[0], node.input[1], [*chain, node.output[0]]


def lower_moe(model: Any) -> int:
    """Rewrite every dgpipe::MoE node of `model` (an onnx.ModelProto, external data not loaded) in place;
    returns how many were lowered."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    new_nodes: list[Any] = []
    dropped: set[str] = set()
    lowered = 0
    axes = f"{NAMESPACE}.moe.reduce_axes"
    for node in graph.node:
        if not (node.domain == NAMESPACE and node.op_type == moe_spec.ONNX_OP):
            new_nodes.append(node)
            continue
        where = f"node {node.name or node.output[0]!r}"
        activation = _attr(node, "activation", moe_spec.ACTIVATION)
        if activation != moe_spec.ACTIVATION:
            raise DgpipeError(f"{where}: MoE activation {activation!r}; the plugin computes gelu_tanh only")
        act_quant = _attr(node, "act_quant", "none")
        hidden, index, weight, gate_up, down = node.input[:5]
        gu8, dn8 = _fp8_source(gate_up, producers, inits), _fp8_source(down, producers, inits)
        if (gu8 is None) != (dn8 is None):
            raise DgpipeError(f"{where}: gate_up and down must both be FP8 or both the model dtype")
        prefix = node.output[0]
        if gu8 is None:
            if act_quant != "none":
                raise DgpipeError(f"{where}: act_quant={act_quant} needs FP8 expert weights")
            op, inputs = moe_spec.EXPERTS_OP, [hidden, index, weight, gate_up, down]
        else:
            casts = []
            for src, tag in ((gu8[1], "gate_up_scale"), (dn8[1], "down_scale")):
                casts.append(f"{prefix}.{tag}")
                new_nodes.append(helper.make_node("Cast", [src], [casts[-1]], to=TensorProto.FLOAT))
            dropped.update(gu8[2] + dn8[2])
            inputs = [hidden, index, weight, gu8[0], casts[0], dn8[0], casts[1]]
            op = moe_spec.W8_OP
            if act_quant == "fp8":
                if len(node.input) < 6 or not node.input[5]:
                    raise DgpipeError(f"{where}: act_quant=fp8 without its input_scale input")
                op = moe_spec.W8A8_OP
                inputs.append(node.input[5])
            elif act_quant != "none":
                raise DgpipeError(f"{where}: unknown act_quant {act_quant!r} (none or fp8)")
        per_choice, summed = f"{prefix}.out_k", f"{prefix}.sum_k"
        new_nodes += [
            helper.make_node(
                op, inputs, [per_choice], name=f"{node.name}.{op}", domain=NAMESPACE,
                plugin_namespace=NAMESPACE, plugin_version="1",
            ),
            helper.make_node("ReduceSum", [per_choice, axes], [summed], keepdims=0),
            helper.make_node("CastLike", [summed, hidden], [node.output[0]]),
        ]  # fmt: skip
        lowered += 1
    if not lowered:
        return 0
    # the DequantizeLinear chains the plugins replaced, unless something else still reads them
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in new_nodes for i in n.input} | outputs
        dead = [n for n in new_nodes if n.output[0] in dropped and not any(o in read for o in n.output)]
        if not dead:
            break
        new_nodes = [n for n in new_nodes if all(n is not d for d in dead)]
    kept = []
    for n in new_nodes:  # copies: the originals belong to the repeated field cleared next
        c = type(n)()
        c.CopyFrom(n)
        kept.append(c)
    del graph.node[:]
    graph.node.extend(kept)
    if axes not in inits:
        graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), axes))
    if not any(o.domain == NAMESPACE for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NAMESPACE, 1))
    return lowered
