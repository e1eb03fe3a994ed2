"""FLOPs and bytes of one pass of an exported graph, counted from the graph itself, and the analytic count.

`graph_cost` binds every symbolic input dim to a number (batch, seq, past lengths), inlines the model-local
functions (so the `dgpipe::MoE` node is counted through its reference body - Gather of the selected experts'
weights, then batched MatMul - i.e. routed; a dense export counts its unrolled experts), runs ONNX shape
inference with data propagation, and sums 2 * M * N * K over every MatMul/Gemm (the tensor-core work;
elementwise ops, softmax and the sampler are < 1% and are not counted). Bytes are the floor every engine
pays: each weight read once (routed: only the experts some token selected - the expected distinct count
under uniform routing, which for a 256-token canvas at top-8 of 128 is all of them), plus the K/V cache read.

`pipeline.model.cost.denoise_pass_flops` is the same count written from the config (the cross-check; BENCHMARKS.md has both).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.inliner
from onnx import TensorProto, helper

from pipeline.model.config import TextConfig
from pipeline.model.cost import denoise_pass_flops
from pipeline.onnx import contract as onnx_io

BYTES = {
    TensorProto.FLOAT: 4,
    TensorProto.BFLOAT16: 2,
    TensorProto.FLOAT16: 2,
    TensorProto.FLOAT8E4M3FN: 1,
    TensorProto.FLOAT4E2M1: 0.5,
}


@dataclass
class PassCost:
    matmul_flops: float
    weight_bytes: float  # weights read once (routed: expected distinct experts)
    kv_bytes: float  # past K/V read

    def as_dict(self) -> dict:
        return asdict(self)


def pass_dims(batch: int, seq: int, past: int, sliding_window: int) -> dict[str, int]:
    """Concrete values of the contract's symbolic dims for one denoise pass over `past` cached tokens."""
    ring = min(past, max(sliding_window - 1, 1))
    return {
        onnx_io.BATCH: batch,
        onnx_io.SEQ: seq,
        onnx_io.SC_SEQ: seq,
        onnx_io.PAST_FULL: past,
        onnx_io.PAST_SLIDING: ring,
        onnx_io.KEYS_FULL: past + seq,
        onnx_io.KEYS_SLIDING: ring + seq,
        onnx_io.HEAD: seq,
    }


def expected_distinct_experts(tokens: int, experts: int, top_k: int) -> float:
    """E * (1 - (1 - K/E)^T): experts some token picks when routing is uniform (an upper bound on reuse)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _bind_inputs(m: onnx.ModelProto, dims: dict[str, int]) -> None:
    for vi in m.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                if d.dim_param not in dims:
                    raise ValueError(f"no value for symbolic dim '{d.dim_param}' of input '{vi.name}'")
                d.dim_value = dims[d.dim_param]


def _drop_sampler(m: onnx.ModelProto) -> None:
    """The sampler nodes have no MatMul; dropping them (and what only they read) keeps shape inference to the
    network + LM head, which it resolves completely."""
    sampler = {op.name for op in onnx_io.CUSTOM_OPS}
    keep = [n for n in m.graph.node if not (n.domain == onnx_io.DOMAIN and n.op_type in sampler)]
    del m.graph.node[:]
    m.graph.node.extend(keep)
    funcs = [f for f in m.functions if f.name not in sampler]
    del m.functions[:]
    m.functions.extend(funcs)
    # the next step's soft embedding (probs @ E) reads SampleRows' probabilities: give them as an input of
    # the logits' shape, so its MatMul (self-conditioning's vocab-wide half) is counted
    logits = next(o for o in m.graph.output if o.name == "logits")
    probs = onnx.ValueInfoProto()
    probs.CopyFrom(logits)
    probs.name = "rows/probs"
    m.graph.input.append(probs)
    outs = [
        o for o in m.graph.output if o.name in ("logits", "next_sc_embed") or o.name.startswith("present.")
    ]
    del m.graph.output[:]
    m.graph.output.extend(outs)
    used = {i for n in m.graph.node for i in n.input}
    ins = [i for i in m.graph.input if i.name in used]
    del m.graph.input[:]
    m.graph.input.extend(ins)


def _shape(vi: onnx.ValueInfoProto | None) -> list[int] | None:
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    return None if any(d is None for d in dims) else dims


def graph_cost(m: onnx.ModelProto, dims: dict[str, int], base_dir: str | None = None) -> PassCost:
    """Count one pass of `m`, loaded WITHOUT external data (a 26B graph is a few MB). Small external
    tensors (shape constants) are read from `base_dir`; weights become value-less inputs for the shape
    inference. Every token of the pass is routed (batch * seq per layer) for the MoE weight bytes."""
    m = onnx.ModelProto.FromString(m.SerializeToString())  # callers keep their model untouched
    moe_weights = {n.input[i] for n in m.graph.node if n.op_type == onnx_io.MOE.name for i in (3, 4)}
    moe_attrs = [
        {a.name: helper.get_attribute_value(a) for a in n.attribute}
        for n in m.graph.node
        if n.op_type == onnx_io.MOE.name
    ]
    inits = {t.name: t for t in m.graph.initializer}
    weights = []
    for t in list(m.graph.initializer):
        small = np.prod(t.dims) <= 64
        if t.data_location == TensorProto.EXTERNAL and small and base_dir is not None:
            onnx.external_data_helper.load_external_data_for_tensor(t, base_dir)
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]
        elif not small or t.data_location == TensorProto.EXTERNAL:
            m.graph.initializer.remove(t)
            weights.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    m.graph.input.extend(weights)
    _drop_sampler(m)
    _bind_inputs(m, dims)
    if dims[onnx_io.HEAD] == dims[onnx_io.SEQ]:  # denoise: the head's Slice(hidden, 0, max(1, seq*mode)) is
        for n in m.graph.node:  # all of `hidden`; shape inference cannot see mode's value, so say it
            for i, name in enumerate(n.input):
                if name == "head/hidden":
                    n.input[i] = "hidden"
    m = onnx.inliner.inline_local_functions(m)
    from onnxruntime.tools.symbolic_shape_infer import (
        SymbolicShapeInference,
    )  # propagates Shape->Reshape values

    m = SymbolicShapeInference.infer_shapes(m, auto_merge=True)
    shapes = {vi.name: _shape(vi) for vi in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    for name, t in inits.items():
        shapes[name] = list(t.dims)
    flops = 0.0
    for n in m.graph.node:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        a, out = shapes.get(n.input[0]), shapes.get(n.output[0])
        if a is None or out is None:
            raise ValueError(f"shape inference left {n.op_type} '{n.name}' unresolved; cannot count it")
        k = a[0] if n.op_type == "Gemm" and _attr(n, "transA") else a[-1]
        flops += 2.0 * float(np.prod(out, dtype=np.float64)) * k
    tokens = dims[onnx_io.BATCH] * dims[onnx_io.SEQ]
    weight_bytes = 0.0
    for name, t in inits.items():
        size = float(np.prod(t.dims, dtype=np.float64)) * BYTES.get(t.data_type, 4)
        if name in moe_weights:
            e, k = moe_attrs[0]["num_experts"], moe_attrs[0]["top_k"]
            size *= expected_distinct_experts(tokens, e, k) / e
        weight_bytes += size
    kv = 0.0
    for vi in m.graph.input:
        if vi.name.startswith("past."):
            kv += float(np.prod(_shape(vi), dtype=np.float64)) * BYTES[vi.type.tensor_type.elem_type]
    return PassCost(flops, weight_bytes, kv)


def denoise_pass_record(model_file: str, cfg: TextConfig, canvas: int) -> dict:
    """What contract.json records as "flops_per_denoise_pass": `graph_cost` of the saved graph (loaded without
    its external data) for one denoise pass at batch 1, seq = canvas, past = canvas (one canvas of context),
    next to `denoise_pass_flops` of the same pass (pipeline.model.cost). Written for routed exports only: their graph is a few MB and
    counts in seconds (a dense export unrolls every expert, which makes shape inference minutes at 26B)."""
    m = onnx.load(model_file, load_external_data=False)
    batch, past = 1, canvas
    c = graph_cost(m, pass_dims(batch, canvas, past, cfg.sliding_window), str(Path(model_file).parent))
    return {
        "batch": batch,
        "seq": canvas,
        "past": past,
        "counted": "MatMul/Gemm FLOPs of the graph (network + LM head; sampler, elementwise excluded)",
        **c.as_dict(),
        "analytic_flops": denoise_pass_flops(cfg, batch, canvas, past, routed=True),
    }


def _attr(n: onnx.NodeProto, name: str) -> int:
    return next((helper.get_attribute_value(a) for a in n.attribute if a.name == name), 0)
