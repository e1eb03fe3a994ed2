"""Export DiffusionGemma + the sampler step as one ONNX graph (contract: `pipeline.onnx.contract`).

Three steps:
  1. `torch.onnx.export` (TorchScript exporter) of `export_graph.GraphModel` -> the network up to the final
     norm, with the contract's input/output names and dynamic axes. Why TorchScript and not dynamo: on this
     model both produce a valid graph, but the dynamo exporter took ~290 s on 2 CPU cores (torch.export's
     symbolic tracing of the unrolled experts) against ~10 s, and it auto-names the mask's key dim ("s58")
     and needs the sc_seq broadcast rewritten; the TorchScript exporter traces plain broadcasting and keeps
     the axis names we give. It stops at opset 20, so the graph is converted to opset 21 afterwards
     (opset 21 only widened types of the ops involved).
  2. Append in ONNX what depends on `mode`: the LM head on `head = max(1, seq * mode)` rows (tied
     embedding, fp32 softcap), then `dgpipe::SampleRows` -> `dgpipe::SampleAccept`, plus their reference
     FunctionProtos (`pipeline.onnx.sampler_functions`) so onnxruntime can run the file, and the next
     step's self-conditioning input from SampleRows' probabilities: Cast(probs) @ E * sqrt(d), the op
     `DiffusionGemma.soft_embedding` runs (so the [B, L, vocab] probabilities stay inside the graph).
  3. Save with all weights as external data, next to contract.json, atomically.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from pipeline.errors import DgpipeError
from pipeline.model.network import DiffusionGemma
from pipeline.onnx import contract as onnx_io
from pipeline.onnx.graph import ExpertsFn, GraphModel, LinearFn
from pipeline.onnx.moe import moe_function
from pipeline.onnx.sampler_functions import sampler_functions

MODEL_DTYPES = {torch.float32: "FLOAT", torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16"}


@dataclass
class ExportSummary:
    path: str
    opset: int
    precision: str
    model_dtype: str
    inputs: list[str]
    outputs: list[str]
    custom_ops: list[str]
    moe: str
    nodes: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def _example_inputs(model: DiffusionGemma) -> tuple:
    """Small example tensors with DISTINCT sizes per symbolic dim (the tracer must not confuse them)."""
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    b, s, sc, pf, ps = 2, 5, 3, 7, 4
    gen = torch.Generator().manual_seed(0)
    past = []
    for i, kind in enumerate(model.layer_types):
        shape = cfg.layer_shape(i)
        n = ps if kind == "sliding_attention" else pf
        past += [torch.randn(b, shape.num_kv_heads, n, shape.head_dim, generator=gen).to(dtype) for _ in "kv"]
    device = next(model.parameters()).device  # meta when tracing without weights

    return tuple(
        [t.to(device) for t in x] if isinstance(x, list) else x.to(device)
        for x in (
            torch.tensor([onnx_io.MODE_DENOISE]),
            torch.randint(0, cfg.vocab_size, (b, s), generator=gen),
            torch.arange(pf, pf + s)[None].expand(b, s).contiguous(),
            torch.randn(b, sc, cfg.hidden_size, generator=gen).to(dtype),
            torch.ones(b, 1, s, pf + s, dtype=torch.bool),
            torch.ones(b, 1, s, ps + s, dtype=torch.bool),
            past,
        )
    )


def _dynamic_axes(layer_types: list[str]) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for spec in (*onnx_io.MODEL_INPUTS, *onnx_io.kv_inputs(layer_types), *onnx_io.kv_outputs(layer_types)):
        axes[spec.name] = {i: d for i, d in enumerate(spec.shape) if isinstance(d, str) and d in _SYMBOLIC}
    axes["hidden"] = {0: onnx_io.BATCH, 1: onnx_io.SEQ}
    return axes


_SYMBOLIC = {
    onnx_io.BATCH,
    onnx_io.SEQ,
    onnx_io.PAST_FULL,
    onnx_io.PAST_SLIDING,
    onnx_io.KEYS_FULL,
    onnx_io.KEYS_SLIDING,
    onnx_io.SC_SEQ,
}


def trace_network(
    model: DiffusionGemma,
    path: Path,
    linear: LinearFn | None = None,
    holder: torch.nn.Module | None = None,
    moe: str = "dense",
    experts: ExpertsFn | None = None,
) -> onnx.ModelProto:
    """Step 1: the network (no head) as ONNX, contract names, opset 20 as the TorchScript exporter writes.

    A model on the meta device (`pipeline.onnx.stream`) is traced WITHOUT its weights: they become graph
    inputs named by parameter ("model.layers.0.mlp.up_proj.weight"), for the caller to bind; no constant
    folding (it would need values) and no initializer de-duplication (it compares values)."""
    meta = next(model.parameters()).is_meta
    lt = list(model.layer_types)
    names = [s.name for s in (*onnx_io.MODEL_INPUTS, *onnx_io.kv_inputs(lt))]
    outputs = [s.name for s in onnx_io.kv_outputs(lt)] + ["hidden"]
    graph = GraphModel(model, linear, moe, experts).eval()
    if holder is not None:  # extra tensors the linear hook reads (exported as initializers "qdq.*")
        graph.qdq = holder
    dedup = torch._C._jit_pass_onnx_deduplicate_initializers
    with (
        warnings.catch_warnings(),
        torch.no_grad(),
        mock.patch.object(
            torch._C, "_jit_pass_onnx_deduplicate_initializers", (lambda g, p, t: p) if meta else dedup
        ),
    ):
        warnings.simplefilter("ignore")  # TracerWarnings about shapes: the dynamic axes cover them
        torch.onnx.export(
            graph,
            _example_inputs(model),
            str(path),
            dynamo=False,
            opset_version=20,
            input_names=names,
            output_names=outputs,
            dynamic_axes=_dynamic_axes(lt),
            do_constant_folding=not meta,
            export_params=not meta,
            custom_opsets={onnx_io.DOMAIN: onnx_io.DOMAIN_VERSION},
        )
    return onnx.load(str(path))


def _find_embedding(graph: onnx.GraphProto) -> str:
    for init in graph.initializer:
        if init.name.endswith("embed_tokens.weight"):
            return init.name
    raise DgpipeError("exported graph has no embed_tokens.weight initializer", "exporter bug: report it")


def append_head_and_sampler(
    m: onnx.ModelProto, dims: dict[str, int], softcap: float, embed_scale: float, model_dtype: str, opset: int
) -> None:
    """Step 2: LM head on max(1, seq * mode) rows, the two sampler nodes and their functions, and the
    next step's soft embedding. `embed_scale`: sqrt(hidden) as the model rounds it to its dtype."""
    vocab = dims["vocab"]
    g = m.graph
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value: np.ndarray) -> str:
        g.initializer.append(onnx.numpy_helper.from_array(value, name))
        return name

    def node(op: str, inputs: list[str], out: str, **kw) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=f"head/{out}", **kw))
        return out

    one = const("head/one", np.array([1], np.int64))
    zero = const("head/zero", np.array([0], np.int64))
    seq = node("Shape", ["hidden"], "head/seq", start=1, end=2)
    n = node("Max", [node("Mul", [seq, "mode"], "head/seq_x_mode"), one], "head/n")
    h = node("Slice", ["hidden", zero, n, one], "head/hidden")
    embed = _find_embedding(g)
    wt = node("Transpose", [embed], "head/embed_t", perm=[1, 0])
    z = node("Cast", [node("MatMul", [h, wt], "head/z")], "head/z32", to=TensorProto.FLOAT)
    cap = const("head/softcap", np.array(softcap, np.float32))
    node("Mul", [node("Tanh", [node("Div", [z, cap], "head/z_cap")], "head/tanh"), cap], "logits")
    tpl = node("Slice", ["template", zero, n, one], "head/template")
    prev = node("Slice", ["prev_argmax", zero, n, one], "head/prev_argmax")
    keys = ["seed", "request", "canvas", "step"]
    nodes.append(
        helper.make_node(
            onnx_io.SAMPLE_ROWS.name,
            ["logits", "temperature", *keys],
            ["rows/entropy", "rows/max_prob", "rows/argmax", "rows/sample", "rows/probs"],
            name="SampleRows",
            domain=onnx_io.DOMAIN,
            **onnx_io.PLUGIN_ATTRIBUTES,
        )
    )
    nodes.append(
        helper.make_node(
            onnx_io.SAMPLE_ACCEPT.name,
            [
                "rows/entropy",
                "rows/argmax",
                "rows/sample",
                tpl,
                "bound",
                *keys,
                prev,
                "stable_count",
                "stability_threshold",
                "confidence_threshold",
            ],
            ["entropy", "kept", "next_canvas", "argmax", "stable_count_out", "stop"],
            name="SampleAccept",
            domain=onnx_io.DOMAIN,
            vocab=vocab,
            **onnx_io.PLUGIN_ATTRIBUTES,
        )
    )
    # next step's self-conditioning input, as DiffusionGemma.soft_embedding: matmul(probs.to(E.dtype), E) * scale
    ty = getattr(TensorProto, model_dtype)
    probs = node("Cast", ["rows/probs"], "soft/probs", to=ty)
    scale = node("Cast", [const("soft/scale32", np.array(embed_scale, np.float32))], "soft/scale", to=ty)
    node("Mul", [node("MatMul", [probs, embed], "soft/matmul"), scale], "next_sc_embed")
    g.node.extend(nodes)
    for spec in onnx_io.SAMPLER_INPUTS:
        g.input.append(_value_info(spec, dims, model_dtype))
    keep = [o for o in g.output if o.name != "hidden"]
    del g.output[:]
    g.output.extend(keep)
    for spec in onnx_io.SAMPLER_OUTPUTS:
        g.output.append(_value_info(spec, dims, model_dtype))
    m.functions.extend(sampler_functions(opset))
    moe = [n for n in g.node if n.domain == onnx_io.DOMAIN and n.op_type == onnx_io.MOE.name]
    if moe:  # one reference body per file: every MoE node of an export has the same act_quant
        act_quant = next(helper.get_attribute_value(a) for a in moe[0].attribute if a.name == "act_quant")
        m.functions.append(moe_function(opset, act_quant.decode()))
    if not any(o.domain == onnx_io.DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(onnx_io.DOMAIN, onnx_io.DOMAIN_VERSION))


def _value_info(spec: onnx_io.TensorSpec, dims: dict[str, int], model_dtype: str) -> onnx.ValueInfoProto:
    """`dims`: the model sizes ("vocab", "hidden") written as numbers, not symbols."""
    dtype = model_dtype if spec.dtype == onnx_io.MODEL else spec.dtype
    shape = [dims.get(d, d) if isinstance(d, str) else d for d in spec.shape]
    return helper.make_tensor_value_info(spec.name, getattr(TensorProto, dtype), shape)


def _rename_dims(m: onnx.ModelProto, model_dtype: str, dims: dict[str, int], layer_types: list[str]) -> None:
    """Give every graph input/output exactly the contract's shape (names of symbolic dims included), the
    K/V's head counts and dims as numbers (`dims` has each layer's `kv_heads_i` / `head_dim_i`: the tracer
    made symbols of some, which a consumer sizing buffers from the signature cannot use)."""
    specs = {
        s.name: s
        for s in (
            *onnx_io.MODEL_INPUTS,
            *onnx_io.SAMPLER_INPUTS,
            *onnx_io.SAMPLER_OUTPUTS,
            *onnx_io.kv_inputs(layer_types),
            *onnx_io.kv_outputs(layer_types),
        )
    }
    for vi in [*m.graph.input, *m.graph.output]:
        if vi.name in specs:
            vi.type.CopyFrom(_value_info(specs[vi.name], dims, model_dtype).type)


# what export_onnx tells `step`, in order (a float export skips "insert Q/DQ"); the caller adds its read
EXPORT_STEPS = (
    "trace network",
    "convert opset",
    "insert Q/DQ",
    "head + sampler",
    "save",
    "check",
    "count FLOPs",
)


def export_onnx(
    model: DiffusionGemma,
    out_dir: Path,
    *,
    precision: str = "fp32",
    linear: LinearFn | None = None,
    holder: torch.nn.Module | None = None,
    post: Callable[[onnx.ModelProto], None] | None = None,
    moe: str = onnx_io.DEFAULT_MOE,
    experts: ExpertsFn | None = None,
    step: Callable[[str], None] | None = None,
) -> ExportSummary:
    """Export to out_dir/model.onnx (+ model.onnx.data, contract.json); out_dir is replaced atomically.
    `step(name)` is told as each of EXPORT_STEPS starts (a watched build's progress).

    `moe` is the MoE form (contract.MOE_FORMS). Quantized exports (`linear` set) are routed only when they
    pass `experts` (the stacked stand-ins their `post` pass replaces by DequantizeLinear: FP8), else dense."""
    from pipeline.atomic import atomic_dir

    start = time.perf_counter()
    dtype = next(model.parameters()).dtype
    if dtype not in MODEL_DTYPES:
        raise DgpipeError(f"cannot export a {dtype} model", "load it as float32 or bfloat16")
    if moe not in onnx_io.MOE_FORMS:
        raise DgpipeError(f"unknown MoE form '{moe}'", f"choose one of: {', '.join(onnx_io.MOE_FORMS)}")
    if linear is not None and experts is None:
        moe = "dense"
    model_dtype = MODEL_DTYPES[dtype]
    step = step or (lambda name: None)
    step("trace network")
    with tempfile.TemporaryDirectory() as scratch:
        m = trace_network(model, Path(scratch) / "net.onnx", linear, holder, moe, experts)
    step("convert opset")
    m = onnx.version_converter.convert_version(m, onnx_io.OPSET)
    if post is not None:  # Q/DQ insertion (NVFP4 raises the opset to 23)
        step("insert Q/DQ")
        post(m)
    step("head + sampler")
    contract = finish_graph(m, model, model_dtype, precision, moe)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, onnx_io.EXPORT_KIND, onnx_io.CONTRACT_FILE) as tmp:
        step("save")
        onnx.save_model(
            m,
            str(tmp / onnx_io.MODEL_FILE),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=onnx_io.WEIGHTS_FILE,
            size_threshold=0,
        )
        step("check")
        onnx.checker.check_model(str(tmp / onnx_io.MODEL_FILE))  # by path: the external data is read too
        step("count FLOPs")
        record_pass_cost(contract, tmp / onnx_io.MODEL_FILE, model)
        (tmp / onnx_io.CONTRACT_FILE).write_text(json.dumps(contract, indent=2) + "\n")
    return summarize(m, out_dir, contract, start)


def finish_graph(
    m: onnx.ModelProto, model: DiffusionGemma, model_dtype: str, precision: str, moe: str, check: bool = True
) -> dict:
    """Step 2 on a traced (opset-converted) network: head + sampler, contract shapes, checker; the contract.
    `check=False` when the initializers already point at an external file (checked by path once saved)."""
    cfg = model.cfg
    lt = list(model.layer_types)
    opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    sizes = {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size}
    scale = float(model.embed_scale)  # sqrt(d) rounded to the weight dtype, as the model applies it
    append_head_and_sampler(m, sizes, cfg.final_logit_softcapping, scale, model_dtype, opset)
    shapes = [cfg.layer_shape(i) for i in range(len(lt))]
    per_layer = {f"kv_heads_{i}": s.num_kv_heads for i, s in enumerate(shapes)}
    per_layer |= {f"head_dim_{i}": s.head_dim for i, s in enumerate(shapes)}
    _rename_dims(m, model_dtype, sizes | per_layer, lt)
    m.ir_version = onnx_io.IR_VERSION if opset < 23 else 11  # FLOAT4E2M1 (opset 23) needs IR 11
    m.producer_name, m.doc_string = (
        "dgpipe",
        f"DiffusionGemma ({precision}) + dgpipe sampler; see docs/onnx.md",
    )
    if check:
        onnx.checker.check_model(m)
    dims = {
        **sizes,
        "canvas_length": model.config.canvas_length,
        "sliding_window": cfg.sliding_window,
        "ring": max(cfg.sliding_window - 1, 1),
    }
    contract = onnx_io.contract_dict(lt, model_dtype, dims, moe)
    contract["opset"] = opset
    contract["layer_types"] = lt
    contract["precision"] = precision
    return contract


def record_pass_cost(contract: dict, model_file: Path, model: DiffusionGemma) -> None:
    """contract["flops_per_denoise_pass"]: the routed graph's own FLOP count of one denoise pass (the engine
    built from it runs these MatMuls; the plugin computes the MoE body's). Routed exports only (see pipeline.onnx.flops.denoise_pass_record), not
    NVFP4: onnxruntime's symbolic shape inference (what graph_cost runs) cannot follow TensorRT's
    trt::TRT_FP4DynamicQuantize nor the MoE body's ReduceMax with axes as an input (opset 23)."""
    if contract["moe"] != "routed" or contract["precision"] == "nvfp4":
        return
    from pipeline.onnx.flops import denoise_pass_record

    contract["flops_per_denoise_pass"] = denoise_pass_record(
        str(model_file), model.cfg, model.config.canvas_length
    )


def summarize(m: onnx.ModelProto, out_dir: Path, contract: dict, start: float) -> ExportSummary:
    opset, moe = contract["opset"], contract["moe"]
    return ExportSummary(
        path=str(Path(out_dir) / onnx_io.MODEL_FILE),
        opset=opset,
        precision=contract["precision"],
        model_dtype=next(i["dtype"] for i in contract["inputs"] if i["name"] == "sc_embed"),
        inputs=[i.name for i in m.graph.input],
        outputs=[o.name for o in m.graph.output],
        custom_ops=[f"{onnx_io.DOMAIN}::{op.name}" for op in onnx_io.custom_ops(moe)],
        moe=moe,
        nodes=len(m.graph.node),
        seconds=time.perf_counter() - start,
    )
