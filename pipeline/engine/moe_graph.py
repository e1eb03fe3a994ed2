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
input_scale), so the engine keeps 1-byte expert weights and the DequantizeLinear nodes go away. NVFP4
weights arrive as FLOAT4E2M1 -> DequantizeLinear(block 16) whose scale is DequantizeLinear(E4M3 block
scales, fp32 global scale) (pipeline/onnx/quant.py insert_routed_nvfp4); the lowering feeds the three
initializers to `MoEExpertsW4` (`W4A4` when act_quant = nvfp4), 4.5 bits per expert weight in the engine.
NVFP4 is lowered only where pipeline.targets allows the precision (a `target` given: sm100 / sm120).
Anything else - a mixed or unknown weight format, an unknown activation - is refused with what to do.
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


def _int_attr(node: Any, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return a.i
    return default


def _dq_source(name: str, producers: dict[str, Any]) -> tuple[Any, list[str]] | None:
    """(the DequantizeLinear behind weight input `name`, the outputs of the chain up to it), or None when
    the weight is not dequantized (model dtype)."""
    chain, node = [], producers.get(name)
    while node is not None and node.op_type in _PASS_THROUGH:
        chain.append(node.output[0])
        node = producers.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear":
        return None
    return node, [*chain, node.output[0]]


def _weight_source(
    name: str, role: str, producers: dict[str, Any], inits: dict[str, Any], where: str
) -> tuple[str, list[str], list[str]] | None:
    """(format "fp8" | "nvfp4", the plugin's inputs for this weight in port order, the outputs of the DQ
    nodes they replace) behind weight input `name`, or None for a model-dtype weight.

    fp8: [E4M3 initializer, its DQ scale]. nvfp4: [FLOAT4E2M1 initializer, E4M3 block scales, global scale]
    from DQ(w, DQ(block_scale, global), axis=-1, block_size=16), the global scale applied as the kernel
    reads it (`role` gate_up: per expert and gate|up half, scale DQ axis 1 in blocks of I rows; down: per
    expert, axis 0). Other packed formats and layouts are refused."""
    from onnx import TensorProto

    found = _dq_source(name, producers)
    if found is None:
        return None
    dq, dropped = found
    packed = inits.get(dq.input[0])
    if packed is not None and packed.data_type == TensorProto.FLOAT8E4M3FN:
        return "fp8", [dq.input[0], dq.input[1]], dropped
    if packed is not None and packed.data_type == TensorProto.FLOAT4E2M1:
        scale = producers.get(dq.input[1])
        block = (
            inits.get(scale.input[0]) if scale is not None and scale.op_type == "DequantizeLinear" else None
        )
        if block is None or block.data_type != TensorProto.FLOAT8E4M3FN or len(scale.input) < 2:
            raise DgpipeError(
                f"{where}: the NVFP4 weight {name!r} is not scaled by DequantizeLinear(E4M3 block scales, "
                "global scale) (the layout pipeline/onnx/quant.py insert_routed_nvfp4 writes)",
                hint="re-export the NVFP4 checkpoint with `dgpipe export`",
            )
        rank = len(packed.dims)
        if _int_attr(dq, "block_size", 0) != moe_spec.NVFP4_BLOCK or _int_attr(dq, "axis", 1) not in (
            -1,
            rank - 1,
        ):
            raise DgpipeError(
                f"{where}: the NVFP4 weight {name!r} must be dequantized in blocks of {moe_spec.NVFP4_BLOCK} "
                "along its last axis (DequantizeLinear axis=-1, block_size=16)"
            )
        axis, block = (1, packed.dims[1] // 2) if role == "gate_up" else (0, 0)
        if _int_attr(scale, "axis", 1) != axis or _int_attr(scale, "block_size", 0) != block:
            want = f"axis={axis}, block_size={block}" if block else f"axis={axis}"
            raise DgpipeError(
                f"{where}: the NVFP4 {role} global scale must be applied by DequantizeLinear {want}, as "
                "pipeline/onnx/quant.py insert_routed_nvfp4 writes it (the layout the kernel reads)"
            )
        return "nvfp4", [dq.input[0], scale.input[0], scale.input[1]], [*dropped, scale.output[0]]
    kind = TensorProto.DataType.Name(packed.data_type) if packed is not None else "a computed tensor"
    raise DgpipeError(
        f"the MoE weight {name!r} is dequantized from {kind}: the MoE plugin has FP8 E4M3, NVFP4 and "
        "model-dtype kernels only",
        hint="build with --precision fp8, nvfp4 or bf16, or export with --moe dense",
    )


def lower_moe(model: Any, target: str | None = None) -> int:
    """Rewrite every dgpipe::MoE node of `model` (an onnx.ModelProto, external data not loaded) in place;
    returns how many were lowered. With `target`, NVFP4 experts are refused where pipeline.targets does not
    run NVFP4 (the engine build passes its target; plan_build has refused such a build already)."""
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
        gu = _weight_source(gate_up, "gate_up", producers, inits, where)
        dn = _weight_source(down, "down", producers, inits, where)
        fmt = gu[0] if gu is not None else None
        if fmt != (dn[0] if dn is not None else None):
            raise DgpipeError(
                f"{where}: gate_up and down must share one format (both FP8, both NVFP4 or both the model "
                f"dtype), got {fmt or 'model dtype'} and {dn[0] if dn else 'model dtype'}"
            )
        prefix = node.output[0]
        quant_act = {None: "none", "fp8": "fp8", "nvfp4": "nvfp4"}[fmt]
        if act_quant not in ("none", quant_act):
            what = "FP8" if act_quant == "fp8" else "NVFP4" if act_quant == "nvfp4" else None
            raise DgpipeError(
                f"{where}: act_quant={act_quant} needs {what} expert weights"
                if what
                else f"{where}: unknown act_quant {act_quant!r} (none, fp8 or nvfp4)"
            )
        if gu is None:
            op, inputs = moe_spec.EXPERTS_OP, [hidden, index, weight, gate_up, down]
        else:
            if fmt == "nvfp4" and target is not None:
                from pipeline.targets import check_precision_on_target

                check_precision_on_target("nvfp4", target)
            inputs = [hidden, index, weight]
            for (_, srcs, chain), tag in ((gu, "gate_up"), (dn, "down")):
                *packed, scale = srcs  # the fp32 scale the kernel reads last: a Cast makes it fp32
                inputs += [*packed, f"{prefix}.{tag}_scale"]
                new_nodes.append(helper.make_node("Cast", [scale], [inputs[-1]], to=TensorProto.FLOAT))
                dropped.update(chain)
            op = {"fp8": moe_spec.W8_OP, "nvfp4": moe_spec.W4_OP}[fmt]
            if act_quant != "none":
                if len(node.input) < 6 or not node.input[5]:
                    raise DgpipeError(f"{where}: act_quant={act_quant} without its input_scale input")
                op = {"fp8": moe_spec.W8A8_OP, "nvfp4": moe_spec.W4A4_OP}[fmt]
                inputs.append(node.input[5])
        per_choice, summed = f"{prefix}.out_k", f"{prefix}.sum_k"
        new_nodes += [
            helper.make_node(
                op, inputs, [per_choice], name=f"{node.name}.{op}", domain=NAMESPACE,
                plugin_namespace=NAMESPACE, plugin_version="1", aot=1,
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
