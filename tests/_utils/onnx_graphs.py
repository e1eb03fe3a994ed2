"""Feeds for one pass of an exported graph, a bf16 graph's fp32 twin, and PyTorch with a graph's
self-conditioning, for the onnxruntime tests."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from pipeline.onnx import contract as onnx_io
from pipeline.onnx.flops import pass_dims
from pipeline.runtime.backends import TorchBackend, conditioning_probs


def random_feeds(path: str, seed: int) -> dict[str, np.ndarray]:
    """A denoise pass of batch 2, 5 canvas rows after 9 cached positions, random inputs of each type."""
    m = onnx.load(path, load_external_data=False)
    rng = np.random.default_rng(seed)
    dims = pass_dims(2, 5, 9, 64) | {onnx_io.PAST_SLIDING: 9, onnx_io.KEYS_SLIDING: 14}
    feeds = {}
    for i in m.graph.input:
        shape = [d.dim_value or dims[d.dim_param] for d in i.type.tensor_type.shape.dim]
        et = i.type.tensor_type.elem_type
        if et == TensorProto.BOOL:
            feeds[i.name] = rng.random(shape) < 0.8
        elif et == TensorProto.FLOAT:
            feeds[i.name] = rng.random(shape, dtype=np.float32)
        else:
            feeds[i.name] = rng.integers(0, 20, shape).astype(np.int64)
    feeds["attention_mask.full"][..., -1] = feeds["attention_mask.sliding"][..., -1] = True  # no empty row
    feeds["mode"] = np.array([onnx_io.MODE_DENOISE], np.int64)
    feeds["template"][:] = feeds["prev_argmax"][:] = -1
    feeds["temperature"][:] = 1.0
    return feeds


def bf16_values(m: onnx.ModelProto) -> set[str]:
    """Values a graph holds in bf16: its bf16 inputs, outputs and Cast(to=BFLOAT16) results."""
    g = m.graph
    typed = [
        v.name
        for v in [*g.input, *g.output, *g.value_info]
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16
    ]
    casts = [n.output[0] for n in g.node if n.op_type == "Cast" and _cast_to(n) == TensorProto.BFLOAT16]
    return {*typed, *casts}


def _cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def fp32_twin(bf16_path: str, keep: set[str]) -> onnx.ModelProto:
    """The bf16 graph with every bf16 value made fp32 except those named in `keep` (what the fp32 export
    itself holds in bf16: its bf16 sampler probabilities): initializers widened exactly, Casts to bf16 made
    Casts to fp32. It computes what the fp32 export of the same (bf16-valued) weights computes when the
    bf16 graph is the fp32 graph plus casts, which is what this twin lets onnxruntime check."""
    m = onnx.load(bf16_path)
    g = m.graph
    for k, t in enumerate(g.initializer):
        if t.data_type == TensorProto.BFLOAT16:
            g.initializer[k].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)
            )
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16 and v.name not in keep:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    for n in g.node:
        if n.op_type == "Cast" and n.output[0] not in keep and _cast_to(n) == TensorProto.BFLOAT16:
            next(a for a in n.attribute if a.name == "to").i = TensorProto.FLOAT
        for a in n.attribute:
            if a.name == "value" and a.t.data_type == TensorProto.BFLOAT16:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
    return m


class GraphConditioningTorchBackend(TorchBackend):
    """PyTorch with an exported graph's self-conditioning input whatever the model's dtype: SampleRows' probs,
    a bf16 model's softmax(bf16(z)) in bf16, as the fused kernels write them."""

    def conditioning(self, logits, sampler, step):
        return conditioning_probs(logits, sampler, step, torch.bfloat16, self._probs_round).to(torch.bfloat16)
