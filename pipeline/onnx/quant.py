"""FP8 / NVFP4 (ModelOpt layout) checkpoints -> ONNX with Q/DQ, and the PyTorch fake-quant reference.

NVFP4 follows ModelOpt's NVFP4QuantExporter (see `insert_nvfp4`); the rest of this docstring is FP8.

A ModelOpt FP8 checkpoint stores, per quantized linear, `weight` (F8_E4M3, [out, in]), `weight_scale`
(F32 scalar) and `input_scale` (F32 scalar); everything else (norms, router, embedding) stays float.
The exported graph keeps the packed weights as they are:

    w8 (FLOAT8E4M3FN initializer) -> DequantizeLinear(weight_scale) -> Transpose -> MatMul
    x -> QuantizeLinear(input_scale, fp8 zero point) -> DequantizeLinear(input_scale) ----^

which is TensorRT's explicit-quantization pattern for an FP8 GEMM, in standard-domain ops (ModelOpt's
torch export writes `trt::TRT_FP8QuantizeLinear` / `TRT_FP8DequantizeLinear`, its ONNX exporter then the
standard DequantizeLinear for weights). The
packed tensors come from `pipeline.model.modelopt` (the one ModelOpt-format reader); the float model used
for tracing is `load_model` without activation fake-quant (the graph carries its own Q/DQ).
`fp8_reference_linear` is the plain-PyTorch fake-quant of the same arithmetic, the oracle for the
onnxruntime parity test.

In a bf16 graph (what TensorRT builds: its FP8 / NVFP4 expert plugins take bf16 hidden states) the Q/DQ
pairs stay in fp32, ModelOpt's "QDQ in Float" option for strongly typed networks (its default writes them
in the model dtype): x -> Cast(FLOAT) -> Q -> DQ -> Cast(BFLOAT16), and each dequantized weight ->
Cast(BFLOAT16); the MatMul runs in the model dtype. Whether TensorRT fuses across those Casts is open
(docs/engine.md). ONNX's QuantizeLinear takes x and its scale in one type below opset 25, and the scales stay the
checkpoint's fp32 values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from pipeline.errors import CheckpointError
from pipeline.model.checkpoint import load_model
from pipeline.model.fake_quant import NVFP4_BLOCK, fp8_fake_quant
from pipeline.model.modelopt import PackedLinear, read_packed_linears
from pipeline.model.network import DiffusionGemma
from pipeline.onnx import contract as onnx_io
from pipeline.onnx.graph import ExpertsFn, LinearFn

HOLDER_PREFIX = "qdq."  # the stand-ins' names in the traced graph (`trace_network` holds them as `qdq`)
# the stored tensors each exportable format needs per linear (the activation scale feeds the Q/DQ pair)
EXPORT_NEEDS = {
    "fp8": ("weight_scale", "input_scale"),
    "nvfp4": ("weight_scale", "weight_scale_2", "input_scale"),
}


def read_fp8_checkpoint(
    ckpt_dir: Path, dtype: torch.dtype = torch.float32
) -> tuple[DiffusionGemma, dict[str, PackedLinear]]:
    """The float model in `dtype` (weights dequantized) and the packed FP8 linears keyed by runtime module
    path ("layers.0.self_attn.q_proj", "layers.0.experts.3.gate_proj", ...)."""
    model, quant = read_quantized_checkpoint(ckpt_dir, dtype)
    if any(q.format != "fp8" for q in quant.values()):
        raise CheckpointError(f"{ckpt_dir}: not an FP8 checkpoint")
    return model, quant


def read_quantized_checkpoint(
    ckpt_dir: Path, dtype: torch.dtype = torch.float32
) -> tuple[DiffusionGemma, dict[str, PackedLinear]]:
    """Like read_fp8_checkpoint, for FP8 and NVFP4 linears."""
    quant = check_exportable(read_packed_linears(Path(ckpt_dir)), ckpt_dir)
    model, _ = load_model(ckpt_dir, dtype=dtype, fake_quant_inputs=False)
    return model, quant


def check_exportable(quant: dict[str, PackedLinear], ckpt_dir: Path, fmt: str | None = None) -> dict:
    """`quant` when every linear has an ONNX export with the tensors it needs (and, given `fmt`, is in that
    one format), else a CheckpointError naming the linear."""
    if not quant:
        raise CheckpointError(f"{ckpt_dir}: no quantized weights", "is this a ModelOpt FP8/NVFP4 checkpoint?")
    for path, q in quant.items():
        needs = EXPORT_NEEDS.get(q.format)
        if needs is None:
            raise CheckpointError(
                f"{ckpt_dir}: {q.format} linear '{path}' has no ONNX export", "use FP8 or NVFP4"
            )
        missing = [s for s in needs if getattr(q, s) is None]
        if missing:
            raise CheckpointError(f"{ckpt_dir}: {q.format.upper()} linear '{path}' lacks {'/'.join(missing)}")
    if fmt is not None and any(q.format != fmt for q in quant.values()):
        raise CheckpointError(
            f"{ckpt_dir}: mixes NVFP4 and FP8 linears", "export one precision per checkpoint"
        )
    return quant


def fp8_reference_linear(model: DiffusionGemma, quant: dict[str, PackedLinear]) -> LinearFn:
    """PyTorch fake-quant linears: the oracle for the Q/DQ graph."""

    def linear(path: str, x: torch.Tensor) -> torch.Tensor:
        q = quant.get(path)
        if q is None:
            return F.linear(x, _float_weight(model, path))
        return F.linear(fp8_fake_quant(x, q.input_scale), q.dequantized().to(x.dtype))

    return linear


def _float_weight(model: DiffusionGemma, path: str) -> torch.Tensor:
    parts = path.split(".")
    if len(parts) > 3 and parts[2] == "experts":  # layers.N.experts.E.{gate,up,down}_proj
        experts = model.get_submodule(".".join(parts[:3]))
        e, which = int(parts[3]), parts[4]
        inner = experts.gate_up_proj.shape[1] // 2
        if which == "down_proj":
            return experts.down_proj[e]
        return experts.gate_up_proj[e][:inner] if which == "gate_proj" else experts.gate_up_proj[e][inner:]
    return model.get_submodule(path).weight


def unpacked_shape(q: PackedLinear) -> tuple[int, int]:
    """[out, in] of a packed linear's weight (NVFP4 stores two codes per byte along `in`)."""
    out_f, stored_in = q.weight.shape
    return out_f, stored_in * (2 if q.format == "nvfp4" else 1)


def _stand_in(q: PackedLinear, dtype: torch.dtype, meta: bool) -> torch.Tensor:
    """A linear's transposed [in, out] weight in the model dtype: its dequantized values, or on the meta
    device (the streaming export traces without values: the Q/DQ insertion replaces it either way)."""
    if meta:
        out_f, in_f = unpacked_shape(q)
        return torch.empty(in_f, out_f, dtype=dtype, device="meta")
    return q.dequantized().t().to(dtype).contiguous()


class _Holder(nn.Module):
    """Stand-ins in the model dtype for the packed weights while tracing, one named buffer per quantized
    linear (the Q/DQ insertion reads the model dtype from them). `meta`: shapes only (`_stand_in`)."""

    def __init__(self, quant: dict, dtype: torch.dtype, meta: bool = False) -> None:
        super().__init__()
        self.paths = sorted(quant)
        for k, path in enumerate(self.paths):
            self.register_buffer(f"w{k}", _stand_in(quant[path], dtype, meta))


def _raw(t: Any) -> bytes:
    """A packed tensor's bytes as stored (float8 / uint8 viewed as bytes)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class Initializers(Protocol):
    """Where the Q/DQ insertion reads the stand-ins and writes the packed tensors: the traced model proto
    itself (`InMemory`: the tensors' bytes in the proto, saved as external data afterwards), or the
    external-data file of the streaming export (`pipeline.onnx.stream`, which copies each tensor from its
    safetensors shard). A part is a tensor, or for the streaming export a stored tensor not read yet."""

    def model_type(self, stand_in: str) -> int:
        """The ONNX element type of a stand-in (the graph's model dtype)."""

    def drop(self, stand_in: str) -> None:
        """Remove a stand-in the insertion replaced."""

    def packed(self, name: str, data_type: int, shape: list[int], parts: list[Any]) -> onnx.TensorProto:
        """An initializer of the parts' bytes, concatenated in order, under `shape`."""

    def floats(self, name: str, values: Any) -> onnx.TensorProto:
        """A small fp32 initializer (scales)."""


class InMemory:
    """`Initializers` in the traced proto: the stand-ins are its initializers."""

    def __init__(self, g: onnx.GraphProto) -> None:
        self.g = g
        self.inits = {t.name: t for t in g.initializer}

    def model_type(self, stand_in: str) -> int:
        if stand_in not in self.inits:
            raise RuntimeError(f"traced graph lost the stand-in weight {stand_in}")
        return self.inits[stand_in].data_type

    def drop(self, stand_in: str) -> None:
        self.g.initializer.remove(self.inits.pop(stand_in))

    def packed(self, name: str, data_type: int, shape: list[int], parts: list[Any]) -> onnx.TensorProto:
        return helper.make_tensor(name, data_type, shape, b"".join(_raw(p) for p in parts), raw=True)

    def floats(self, name: str, values: Any) -> onnx.TensorProto:
        return onnx.numpy_helper.from_array(np.asarray(values, np.float32), name)


def _trace_linear(model: DiffusionGemma, holder: _Holder) -> LinearFn:
    index = {p: k for k, p in enumerate(holder.paths)}

    def linear(path: str, x: torch.Tensor) -> torch.Tensor:
        k = index.get(path)
        if k is None:
            return F.linear(x, _float_weight(model, path))
        return torch.matmul(x, getattr(holder, f"w{k}"))

    return linear


def _in_model_dtype(name: str, model_type: int) -> tuple[str, list[onnx.NodeProto]]:
    """Where a fp32 DequantizeLinear must write so that `name` holds its value in the model dtype: `name`
    itself in a fp32 graph, else `name`_f32 and a Cast to `name`."""
    if model_type == TensorProto.FLOAT:
        return name, []
    f32 = f"{name}_f32"
    return f32, [helper.make_node("Cast", [f32], [name], to=model_type, name=f"{name}/cast")]


def _as_float(x: str, path: str, model_type: int) -> tuple[str, list[onnx.NodeProto]]:
    """x as the fp32 input of linear `path`'s Q node: x itself in a fp32 graph, else Cast(x, FLOAT) (one
    per linear: q, k and v share their x, and TensorRT fuses each Cast into its own quantize)."""
    if model_type == TensorProto.FLOAT:
        return x, []
    x32 = f"{path}/x_f32"
    return x32, [helper.make_node("Cast", [x], [x32], to=TensorProto.FLOAT, name=x32)]


def _splice(g: onnx.GraphProto, before: dict[int, list[onnx.NodeProto]]) -> None:
    """Insert new nodes ahead of the node at each index, keeping the graph topologically sorted."""
    nodes = []
    for idx, node in enumerate(g.node):
        nodes.extend(before.get(idx, []))
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)


# A linear's weight, dequantized into the model dtype, by its format: fn(output name) -> nodes
WeightDQ = Callable[[str], list[onnx.NodeProto]]
# Its input quantized and dequantized: fn(fp32 input, output name) -> nodes
InputQDQ = Callable[[str, str], list[onnx.NodeProto]]


def _replace_stand_ins(
    g: onnx.GraphProto,
    holder: _Holder,
    prefix: str,
    inits: Initializers,
    rewrite: Callable[[str, int], tuple[WeightDQ, InputQDQ]],
) -> None:
    """Each stand-in weight `{prefix}w{k}` out, its MatMul fed Q/DQ instead: `rewrite(path, model type)` adds
    the linear's initializers and returns how its format dequantizes the weight and Q/DQs the input; the
    rest (casts around the fp32 Q/DQ nodes in a bf16 graph, the weight's transpose, the rewiring) is the
    same for every format."""
    before: dict[int, list[onnx.NodeProto]] = {}
    for k, path in enumerate(holder.paths):
        stand_in = f"{prefix}w{k}"
        model_type = inits.model_type(stand_in)
        inits.drop(stand_in)
        weight_dq, input_qdq = rewrite(path, model_type)
        for idx, node in enumerate(g.node):
            if stand_in not in node.input:
                continue
            if node.op_type != "MatMul" or list(node.input).index(stand_in) != 1:
                raise RuntimeError(f"{stand_in} feeds {node.op_type}, expected MatMul's second input")
            x, x_cast = _as_float(node.input[0], path, model_type)
            w_dq, w_cast = _in_model_dtype(f"{path}/w_dq", model_type)
            x_dq, x_back = _in_model_dtype(f"{path}/x_dq", model_type)
            transpose = helper.make_node(
                "Transpose", [f"{path}/w_dq"], [f"{path}/w_t"], perm=[1, 0], name=f"{path}/w_t"
            )
            new = [*weight_dq(w_dq), *w_cast, transpose, *x_cast, *input_qdq(x, x_dq), *x_back]
            node.input[0], node.input[1] = f"{path}/x_dq", f"{path}/w_t"
            before.setdefault(idx, []).extend(new)
    _splice(g, before)


def insert_qdq(
    m: onnx.ModelProto,
    holder: _Holder,
    quant: dict[str, PackedLinear],
    prefix: str,
    inits: Initializers | None = None,
) -> None:
    """Replace each stand-in `{prefix}w{k}` by FP8 weight + DQ, and Q/DQ its MatMul's input."""
    g = m.graph
    inits = inits or InMemory(g)
    zp = "qdq.fp8_zero_point"
    g.initializer.append(helper.make_tensor(zp, TensorProto.FLOAT8E4M3FN, [], [0.0]))

    def rewrite(path: str, model_type: int) -> tuple[WeightDQ, InputQDQ]:
        q = quant[path]
        w8 = inits.packed(f"{path}.weight", TensorProto.FLOAT8E4M3FN, list(q.weight.shape), [q.weight])
        ws = inits.floats(f"{path}.weight_scale", q.weight_scale)
        xs = inits.floats(f"{path}.input_scale", q.input_scale)
        g.initializer.extend([w8, ws, xs])

        def weight_dq(w_dq: str) -> list[onnx.NodeProto]:
            return [helper.make_node("DequantizeLinear", [w8.name, ws.name], [w_dq], name=f"{path}/w_dq")]

        def input_qdq(x: str, x_dq: str) -> list[onnx.NodeProto]:
            return [
                helper.make_node("QuantizeLinear", [x, xs.name, zp], [f"{path}/x_q"], name=f"{path}/x_q"),
                helper.make_node("DequantizeLinear", [f"{path}/x_q", xs.name], [x_dq], name=f"{path}/x_dq"),
            ]

        return weight_dq, input_qdq

    _replace_stand_ins(g, holder, prefix, inits, rewrite)


def insert_nvfp4(
    m: onnx.ModelProto,
    holder: _Holder,
    quant: dict[str, PackedLinear],
    prefix: str,
    inits: Initializers | None = None,
) -> None:
    """NVFP4 as ModelOpt's NVFP4QuantExporter writes it (TensorRT >= 11): per weight
    DQ(block_scale_f8, weight_scale_2) -> DQ(w_f4 FLOAT4E2M1, axis=-1, block_size=16) -> Transpose -> MatMul;
    per activation trt::TRT_FP4DynamicQuantize(x, input_scale) -> (x_f4, scale_f8) -> DQ -> DQ(blocked).
    FLOAT4E2M1 needs opset 23 / IR 11. onnxruntime cannot run TRT_FP4DynamicQuantize: checker-level."""
    g = m.graph
    inits = inits or InMemory(g)
    blocked = {"axis": -1, "block_size": NVFP4_BLOCK}

    def rewrite(path: str, model_type: int) -> tuple[WeightDQ, InputQDQ]:
        q = quant[path]
        w4 = inits.packed(f"{path}.weight", TensorProto.FLOAT4E2M1, list(unpacked_shape(q)), [q.weight])
        bs = inits.packed(
            f"{path}.weight_scale", TensorProto.FLOAT8E4M3FN, list(q.weight_scale.shape), [q.weight_scale]
        )
        ws2 = inits.floats(f"{path}.weight_scale_2", q.weight_scale_2)
        xs = inits.floats(f"{path}.input_scale", q.input_scale)
        g.initializer.extend([w4, bs, ws2, xs])

        def weight_dq(w_dq: str) -> list[onnx.NodeProto]:
            return [
                helper.make_node(
                    "DequantizeLinear", [bs.name, ws2.name], [f"{path}/w_scale"], name=f"{path}/w_scale"
                ),
                helper.make_node(
                    "DequantizeLinear", [w4.name, f"{path}/w_scale"], [w_dq], name=f"{path}/w_dq", **blocked
                ),
            ]

        def input_qdq(x: str, x_dq: str) -> list[onnx.NodeProto]:
            return [
                helper.make_node(
                    "TRT_FP4DynamicQuantize",
                    [x, xs.name],
                    [f"{path}/x_f4", f"{path}/x_scale_f8"],
                    name=f"{path}/x_q",
                    domain="trt",
                    axis=-1,
                    block_size=NVFP4_BLOCK,
                    scale_type=TensorProto.FLOAT8E4M3FN,
                ),
                helper.make_node(
                    "DequantizeLinear",
                    [f"{path}/x_scale_f8", xs.name],
                    [f"{path}/x_scale"],
                    name=f"{path}/x_scale",
                ),
                helper.make_node(
                    "DequantizeLinear",
                    [f"{path}/x_f4", f"{path}/x_scale"],
                    [x_dq],
                    name=f"{path}/x_dq",
                    **blocked,
                ),
            ]

        return weight_dq, input_qdq

    _replace_stand_ins(g, holder, prefix, inits, rewrite)
    for opset in m.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 23)
    m.opset_import.append(helper.make_opsetid("trt", 1))


def export_nvfp4(
    ckpt_dir: Path, out_dir: Path, moe: str = "routed", step=None, dtype: torch.dtype = torch.float32
):
    """Export a ModelOpt NVFP4 checkpoint as the TensorRT >= 11 FP4 graph (checker-level; see insert_nvfp4).
    `moe="routed"`: the experts go to one dgpipe::MoE node per layer (FP4 stacked weights through the
    two-level DequantizeLinear, act_quant="nvfp4"; see insert_routed_nvfp4), when every expert is NVFP4.
    `dtype`: the graph's model dtype (bf16 for TensorRT; the Q/DQ stay fp32, see the module docstring)."""

    model, quant = read_quantized_checkpoint(Path(ckpt_dir), dtype)
    check_exportable(quant, ckpt_dir, "nvfp4")
    return _export_quantized(model, quant, out_dir, "nvfp4", moe, insert_nvfp4, insert_routed_nvfp4, step)


def export_fp8(
    ckpt_dir: Path,
    out_dir: Path,
    qdq: bool = True,
    moe: str = "routed",
    step=None,
    dtype: torch.dtype = torch.float32,
):
    """Export a ModelOpt FP8 checkpoint: Q/DQ graph (qdq) or plain dequantized float weights (not qdq).
    `moe="routed"`: the experts go to one dgpipe::MoE node per layer (FP8 stacked weights through
    DequantizeLinear, act_quant="fp8"; see insert_routed_fp8), when every expert linear is FP8.
    `dtype`: the graph's model dtype (bf16 for TensorRT; the Q/DQ stay fp32, see the module docstring)."""
    from pipeline.onnx.export import export_onnx

    model, quant = read_fp8_checkpoint(Path(ckpt_dir), dtype)
    if not qdq:
        return export_onnx(model, out_dir, precision="fp8-dequantized", moe=moe, step=step)
    return _export_quantized(model, quant, out_dir, "fp8", moe, insert_qdq, insert_routed_fp8, step)


def _export_quantized(
    model, quant: dict, out_dir: Path, fmt: str, moe: str, insert_linears, insert_routed, step=None
):
    """The Q/DQ export both formats share: the quantized linears through `insert_linears`, and (routed, when
    every expert linear is quantized) the experts as stacked weights of one dgpipe::MoE node per layer.
    `step`: export_onnx's progress callback."""
    from pipeline.onnx.export import export_onnx

    trace = QuantizedTrace.of(model, quant, fmt, moe, next(model.parameters()).dtype)

    def post(m: onnx.ModelProto) -> None:
        trace.insert(m, model, quant, insert_linears, insert_routed)

    return export_onnx(
        model,
        out_dir,
        precision=fmt,
        linear=trace.linear(model),
        holder=trace.holder,
        post=post,
        moe=moe,
        experts=trace.experts,
        step=step,
    )


@dataclass
class QuantizedTrace:
    """What a Q/DQ export traces with, in memory or streamed: the stand-ins (`holder`) for the quantized
    linears they replace (`linears`), and, when every expert is quantized and the MoE is routed, the stacked
    expert stand-ins the routed node takes (`experts`)."""

    holder: _Holder
    linears: dict[str, PackedLinear]
    experts: ExpertsFn | None

    @classmethod
    def of(
        cls, model: DiffusionGemma, quant: dict, fmt: str, moe: str, dtype: torch.dtype, meta: bool = False
    ) -> QuantizedTrace:
        """`meta`: stand-ins on the meta device (the streaming export traces without values)."""
        routed = moe == "routed" and _all_experts_quantized(model, quant, fmt)
        linears = {p: q for p, q in quant.items() if not (routed and _is_expert(p))}
        holder = _Holder(linears, dtype, meta)
        if not routed:
            return cls(holder, linears, None)
        holder.routed = _RoutedExperts(model, quant, fmt, dtype, meta)
        return cls(holder, linears, holder.routed.inputs)

    @property
    def routed(self) -> bool:
        return self.experts is not None

    @property
    def values(self) -> dict[str, torch.Tensor]:
        """Stand-ins' values a meta trace binds by their graph names (the routed experts' input scales)."""
        return (
            {f"{HOLDER_PREFIX}routed.{k}": v for k, v in self.holder.routed.values.items()}
            if self.routed
            else {}
        )

    @property
    def stand_ins(self) -> set[str]:
        """The graph names of the stand-ins the Q/DQ insertion replaces."""
        return {f"{HOLDER_PREFIX}{name}" for name, _ in self.holder.named_buffers()} - set(self.values)

    def linear(self, model: DiffusionGemma) -> LinearFn:
        return _trace_linear(model, self.holder)

    def insert(
        self, m, model, quant, insert_linears, insert_routed, inits: Initializers | None = None
    ) -> None:
        """The Q/DQ of the quantized linears, and of the routed experts when they are routed."""
        insert_linears(m, self.holder, self.linears, HOLDER_PREFIX, inits)
        if self.routed:
            insert_routed(m, model, quant, inits)


def _is_expert(path: str) -> bool:
    return ".experts." in path


def _expert_linears(i: int, e: int, quant: dict[str, PackedLinear]) -> list[PackedLinear | None]:
    return [quant.get(f"layers.{i}.experts.{e}.{p}") for p in ("gate_proj", "up_proj", "down_proj")]


def _all_experts_quantized(model: DiffusionGemma, quant: dict[str, PackedLinear], fmt: str) -> bool:
    return all(
        q is not None and q.format == fmt
        for i, layer in enumerate(model.layers)
        for e in range(layer.experts.num_experts)
        for q in _expert_linears(i, e, quant)
    )


class _RoutedExperts(nn.Module):
    """Per layer: stand-ins in the model dtype for the stacked FP8 / NVFP4 experts (gate_up [E, 2I, d], down
    [E, d, I]) and the experts' activation scales [3, E] (gate, up, down, fp32). Traced as the MoE node's
    inputs; insert_routed_fp8 / insert_routed_nvfp4 then replace the stand-ins by packed initializers + DQ."""

    def __init__(
        self,
        model: DiffusionGemma,
        quant: dict[str, PackedLinear],
        act_quant: str,
        dtype: torch.dtype,
        meta: bool = False,
    ) -> None:
        super().__init__()
        self.act_quant = act_quant
        self.values: dict[str, torch.Tensor] = {}  # buffer name -> the activation scales' values
        for i, layer in enumerate(model.layers):
            rows = [_expert_linears(i, e, quant) for e in range(layer.experts.num_experts)]
            if meta:  # shapes only: the streaming export traces without values
                (inner, d), e_count = unpacked_shape(rows[0][0]), len(rows)
                gate_up = torch.empty(e_count, 2 * inner, d, dtype=dtype, device="meta")
                down = torch.empty(e_count, d, inner, dtype=dtype, device="meta")
            else:
                gate_up = torch.stack([torch.cat([g.dequantized(), u.dequantized()]) for g, u, _ in rows])
                down = torch.stack([d.dequantized() for _, _, d in rows])
            self.register_buffer(f"gate_up{i}", gate_up.to(dtype))
            self.register_buffer(f"down{i}", down.to(dtype))
            scale = torch.tensor([[float(q.input_scale) for q in row] for row in rows]).T.contiguous()
            # traced on the meta device too: its values are bound by name afterwards (`values`)
            self.register_buffer(f"input_scale{i}", scale.to("meta") if meta else scale)
            self.values[f"input_scale{i}"] = scale

    def inputs(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        scale = getattr(self, f"input_scale{i}")
        return getattr(self, f"gate_up{i}"), getattr(self, f"down{i}"), scale, self.act_quant


def insert_routed_fp8(
    m: onnx.ModelProto,
    model: DiffusionGemma,
    quant: dict[str, PackedLinear],
    inits: Initializers | None = None,
) -> None:
    """The MoE nodes' float stand-ins -> FP8 initializers through DequantizeLinear (contract.MOE): gate_up
    blocked along axis 1 with block_size = I (scale [E, 2, d], so gate and up keep their own per-expert
    weight_scale), down per expert along axis 0 (scale [E])."""
    g = m.graph
    inits = inits or InMemory(g)
    nodes = [n for n in g.node if n.op_type == onnx_io.MOE.name]
    if len(nodes) != len(model.layers):
        raise RuntimeError(f"traced graph has {len(nodes)} MoE nodes for {len(model.layers)} layers")
    dq = []
    for i, node in enumerate(nodes):
        e_count = model.layers[i].experts.num_experts
        rows = [_expert_linears(i, e, quant) for e in range(e_count)]
        inner, d = rows[0][0].weight.shape
        model_type = inits.model_type(node.input[3])
        for name in node.input[3:5]:
            inits.drop(name)
        # stacked [E, 2I, d] and [E, d, I]: expert after expert, gate before up, as the bytes are stored
        w_gu = [w for gq, uq, _ in rows for w in (gq.weight, uq.weight)]
        w_down = [dq_.weight for _, _, dq_ in rows]
        s_gu = torch.tensor([[float(gq.weight_scale), float(uq.weight_scale)] for gq, uq, _ in rows])
        s_gu = s_gu[:, :, None].expand(e_count, 2, d).contiguous()
        s_down = torch.tensor([float(dq_.weight_scale) for _, _, dq_ in rows])
        prefix = f"layers.{i}.experts"
        for name, parts, shape, s in (
            ("gate_up_proj", w_gu, [e_count, 2 * inner, d], s_gu),
            ("down_proj", w_down, [e_count, d, inner], s_down),
        ):
            g.initializer.append(
                inits.packed(f"{prefix}.{name}.weight", TensorProto.FLOAT8E4M3FN, shape, parts)
            )
            g.initializer.append(inits.floats(f"{prefix}.{name}.weight_scale", s.numpy()))
        gate_up, gate_up_cast = _in_model_dtype(node.input[3], model_type)
        down, down_cast = _in_model_dtype(node.input[4], model_type)
        dq.append(
            helper.make_node(
                "DequantizeLinear",
                [f"{prefix}.gate_up_proj.weight", f"{prefix}.gate_up_proj.weight_scale"],
                [gate_up],
                name=f"{prefix}/gate_up_dq",
                axis=1,
                block_size=inner,
            )
        )
        dq.append(
            helper.make_node(
                "DequantizeLinear",
                [f"{prefix}.down_proj.weight", f"{prefix}.down_proj.weight_scale"],
                [down],
                name=f"{prefix}/down_dq",
                axis=0,
            )
        )
        dq += [*gate_up_cast, *down_cast]
    _splice(g, {0: dq})


def insert_routed_nvfp4(
    m: onnx.ModelProto,
    model: DiffusionGemma,
    quant: dict[str, PackedLinear],
    inits: Initializers | None = None,
) -> None:
    """The MoE nodes' float stand-ins -> stacked NVFP4 experts as insert_nvfp4 writes one linear, per layer:
        gate_up: DQ(block_scale F8 [E, 2I, d/16], weight_scale_2 [E, 2, d/16], axis=1, block_size=I)
                 -> DQ(w FLOAT4E2M1 [E, 2I, d], axis=-1, block_size=16)
        down:    DQ(block_scale F8 [E, d, I/16], weight_scale_2 [E], axis=0)
                 -> DQ(w FLOAT4E2M1 [E, d, I], axis=-1, block_size=16)
    (gate and up keep their own weight_scale_2 through the axis-1 block of I rows). The bytes are the
    checkpoint's, and the DQ chain computes e2m1 x (block_scale x weight_scale_2), PackedLinear.dequantized's
    order, so the node sees exactly the checkpoint's dequantized weights."""
    g = m.graph
    inits = inits or InMemory(g)
    nodes = [n for n in g.node if n.op_type == onnx_io.MOE.name]
    if len(nodes) != len(model.layers):
        raise RuntimeError(f"traced graph has {len(nodes)} MoE nodes for {len(model.layers)} layers")
    dq = []
    for i, node in enumerate(nodes):
        rows = [_expert_linears(i, e, quant) for e in range(model.layers[i].experts.num_experts)]
        e_count, (inner, d) = len(rows), unpacked_shape(rows[0][0])
        model_type = inits.model_type(node.input[3])
        for name in node.input[3:5]:
            inits.drop(name)
        ws2_gu = torch.tensor([[float(gq.weight_scale_2), float(uq.weight_scale_2)] for gq, uq, _ in rows])
        ws2_gu = ws2_gu[:, :, None].expand(e_count, 2, d // NVFP4_BLOCK).contiguous()
        ws2_down = torch.tensor([float(dq_.weight_scale_2) for _, _, dq_ in rows])
        prefix = f"layers.{i}.experts"
        # stacked per layer, expert after expert (gate before up), as the bytes are stored
        parts = (
            ("gate_up_proj", [w for gq, uq, _ in rows for w in (gq.weight, uq.weight)],
             [s for gq, uq, _ in rows for s in (gq.weight_scale, uq.weight_scale)], ws2_gu, [2 * inner, d],
             {"axis": 1, "block_size": inner}),
            ("down_proj", [dq_.weight for _, _, dq_ in rows], [dq_.weight_scale for _, _, dq_ in rows],
             ws2_down, [d, inner], {"axis": 0}),
        )  # fmt: skip
        for (name, w4, bs, ws2, shape, scale_axis), target in zip(parts, node.input[3:5], strict=True):
            base = f"{prefix}.{name}"
            w_dq, cast = _in_model_dtype(target, model_type)
            scale_shape = [e_count, shape[0], shape[1] // NVFP4_BLOCK]
            g.initializer.extend(
                [
                    inits.packed(f"{base}.weight", TensorProto.FLOAT4E2M1, [e_count, *shape], w4),
                    inits.packed(f"{base}.weight_scale", TensorProto.FLOAT8E4M3FN, scale_shape, bs),
                    inits.floats(f"{base}.weight_scale_2", ws2.numpy()),
                ]
            )
            dq += [
                helper.make_node(
                    "DequantizeLinear",
                    [f"{base}.weight_scale", f"{base}.weight_scale_2"],
                    [f"{base}/w_scale"],
                    name=f"{base}/w_scale",
                    **scale_axis,
                ),
                helper.make_node(
                    "DequantizeLinear",
                    [f"{base}.weight", f"{base}/w_scale"],
                    [w_dq],
                    name=f"{base}/w_dq",
                    axis=-1,
                    block_size=NVFP4_BLOCK,
                ),
                *cast,
            ]
    _splice(g, {0: dq})


# format -> (the quantized linears' Q/DQ insertion, the routed experts'), both exports' (in memory, streamed)
INSERTS = {"fp8": (insert_qdq, insert_routed_fp8), "nvfp4": (insert_nvfp4, insert_routed_nvfp4)}
