"""Export without materialising the model: trace on the meta device, stream weights into external data.

`export_onnx` loads the whole model (the 26B is ~50 GB at bf16, ~100 GB as the fp32 stand-in) before tracing.
Here the network is built on the meta device (shapes only), traced with its weights as named graph inputs
(`pipeline.onnx.export.trace_network`), and each of those inputs is then bound to its tensor in the
checkpoint's safetensors shards: the bytes are copied (and converted, if the export dtype differs) from the
shard into `model.onnx.data` in fixed-size chunks, one tensor at a time, and the graph gets an EXTERNAL
initializer pointing at them. Host memory is therefore the traced graph plus one chunk, whatever the
checkpoint size (BENCHMARKS.md "Export memory" has the 26B measurement).

Why read the shards with plain file reads and not `safetensors.safe_open`: safe_open memory-maps the shard,
and every page touched stays in the process's resident set until the handle closes - a 5 GB shard would
count 5 GB against the bound. The safetensors layout is a documented 8-byte header length, a JSON header
({name: {dtype, shape, data_offsets}}), then the raw little-endian bytes, so a reader is a few lines.

The graph is the in-memory export's graph up to two things its constant folding does: transposed weights
stay `Transpose` nodes on the named weights (TensorRT folds them at build time), and equal-valued tensors are
not de-duplicated. Outputs are bit-identical (tests/unit/onnx/test_stream.py).

ModelOpt FP8 / NVFP4 checkpoints stream too (`export_quantized_streaming`): the quantized linears trace as
meta stand-ins (`pipeline.onnx.quant`), and the Q/DQ insertion, given this module's `Streamed` initializers,
copies each packed weight and block scale from its shard into the external data (a routed layer's experts
one after another: the stacked tensor, byte for byte) and reads only the per-tensor scales. The graph is the
in-memory Q/DQ export's, up to the same two differences (tests/unit/onnx/test_stream.py).
"""

from __future__ import annotations

import json
import math
import re
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto

from pipeline.errors import CheckpointError, DgpipeError
from pipeline.model.checkpoint import open_checkpoint
from pipeline.model.config import ModelConfig
from pipeline.model.files import DECODER, runtime_name, weight_files
from pipeline.model.network import DiffusionGemma, rope_inv_freq
from pipeline.onnx import contract as onnx_io
from pipeline.onnx.export import (
    MODEL_DTYPES,
    ExportSummary,
    finish_graph,
    record_pass_cost,
    summarize,
    trace_network,
)

CHUNK = 64 << 20  # bytes copied per read: the streaming buffer
ALIGN = 64  # each tensor starts on a 64-byte boundary in model.onnx.data
GRAPH_PREFIX = "model."  # GraphModel holds the network as `self.model`

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
PACKED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}  # ModelOpt's packed weights and scales
ONNX_DTYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float16: TensorProto.FLOAT16,
}


def safetensors_index(
    path: Path, packed: bool = False
) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, absolute byte offset, byte length) from one shard's header. `packed`: ModelOpt's
    float8 / uint8 tensors too (the quantized export)."""
    dtypes = SAFETENSORS_DTYPES | (PACKED_DTYPES if packed else {})
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise CheckpointError(
                f"{path}: tensor '{name}' is {info['dtype']}",
                "a float or ModelOpt FP8/NVFP4 checkpoint exports",
            )
        begin, end = info["data_offsets"]
        out[name] = (dtypes[info["dtype"]], tuple(info["shape"]), 8 + n + begin, end - begin)
    return out


@dataclass(frozen=True)
class Stored:
    """A tensor in a safetensors shard, not read: where its bytes are (the streaming export copies them)."""

    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    length: int

    def read(self) -> torch.Tensor:
        """Its values (for the small ones: per-tensor and per-channel scales)."""
        with open(self.shard, "rb") as f:
            f.seek(self.offset)
            data = bytearray(f.read(self.length))
        if len(data) != self.length:
            raise CheckpointError(f"{self.shard}: truncated inside a tensor")
        return torch.frombuffer(data, dtype=self.dtype).reshape(self.shape)


def stored_packed_linears(ckpt_dir: Path) -> dict[str, Any]:
    """`pipeline.model.modelopt.read_packed_linears` without reading the packed tensors: each quantized
    linear's weight and float8 block scales as `Stored`, its per-tensor (or per-channel) scales read."""
    from pipeline.model.modelopt import LINEAR_AUX, PackedLinear, is_packed, precision_of, quantization_info

    info = quantization_info(ckpt_dir)
    if info is None:
        raise CheckpointError(f"{ckpt_dir}: not a ModelOpt-quantized checkpoint")
    algo = str(info.get("quant_algo"))
    precision_of(algo)
    index: dict[str, Stored] = {}
    for shard in sorted(set(weight_files(ckpt_dir).values())):
        for name, (dtype, shape, off, length) in safetensors_index(shard, packed=True).items():
            index[name] = Stored(shard, dtype, shape, off, length)
    out = {}
    for name, st in index.items():
        target = runtime_name(name)
        if target is None or not name.endswith(".weight") or not is_packed(torch.empty(0, dtype=st.dtype)):
            continue
        base = name.removesuffix("weight")
        aux = {s: index[base + s] for s in LINEAR_AUX if base + s in index}
        # block scales stay where they are (1/16 of the weights' elements); scalars and vectors are read
        read = {
            s: t if t.dtype == torch.float8_e4m3fn and len(t.shape) == 2 else t.read() for s, t in aux.items()
        }
        out[target.removesuffix(".weight")] = PackedLinear(algo, st, **read)  # type: ignore[arg-type]
    return out


class Streamed:
    """`pipeline.onnx.quant.Initializers` of the streaming export: the stand-ins are the meta trace's graph
    inputs (dropped with the other weight inputs), every packed tensor is copied from its shard."""

    def __init__(self, m: onnx.ModelProto, writer: ExternalDataWriter) -> None:
        self.types = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
        self.writer = writer

    def model_type(self, stand_in: str) -> int:
        if stand_in not in self.types:
            raise RuntimeError(f"traced graph lost the stand-in weight {stand_in}")
        return self.types[stand_in]

    def drop(self, stand_in: str) -> None:
        pass  # a weight input: the export keeps only the model's inputs

    def packed(self, name: str, data_type: int, shape: list[int], parts: list[Any]) -> TensorProto:
        return self.writer.copy_parts(name, data_type, tuple(shape), parts)

    def floats(self, name: str, values: Any) -> TensorProto:
        a = np.array(values, dtype=np.float32, order="C")  # 0-d stays 0-d (ascontiguousarray makes it 1-d)
        return self.writer.write_raw(name, TensorProto.FLOAT, tuple(a.shape), a.tobytes())


class ExternalDataWriter:
    """Appends tensors to one external-data file and returns initializers that point at them."""

    def __init__(
        self, path: Path, append: bool = False, on_copy: Callable[[int], None] | None = None
    ) -> None:
        self.f = open(path, "ab" if append else "wb")  # noqa: SIM115 - closed by close()
        self.offset = self.f.tell()
        self.buf: bytearray | None = None
        self.on_copy = (
            on_copy  # told the bytes read from a shard, chunk by chunk (a watched export's progress)
        )

    def _begin(self) -> int:
        pad = -self.offset % ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        return self.offset

    def _initializer(self, name: str, data_type: int, shape: tuple[int, ...], start: int) -> TensorProto:
        t = TensorProto(name=name, data_type=data_type, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", onnx_io.WEIGHTS_FILE), ("offset", start), ("length", self.offset - start)):
            entry = t.external_data.add()
            entry.key, entry.value = k, str(v)
        return t

    def copy_parts(
        self,
        name: str,
        data_type: int,
        shape: tuple[int, ...],
        parts: list[Stored],
        dst: torch.dtype | None = None,
    ) -> TensorProto:
        """One initializer of stored tensors one after another (one tensor, or a stacked one without stacking
        it in memory), copied chunk by chunk and converted to `dst` (None: bytes as stored); never holds
        more than CHUNK."""
        start = self._begin()
        for p in parts:
            self._copy(p, dst or p.dtype, name)
        return self._initializer(name, data_type, shape, start)

    def _copy(self, stored: Stored, dst: torch.dtype, name: str) -> None:
        """Append a stored tensor's bytes (converted to `dst`) at the current offset, CHUNK at a time."""
        item = torch.empty((), dtype=stored.dtype).element_size()
        step = CHUNK - CHUNK % item
        if self.buf is None:  # one buffer for the whole export: allocating per tensor costs a memset
            self.buf = bytearray(CHUNK)
        buf = self.buf
        with open(stored.shard, "rb") as f:
            f.seek(stored.offset)
            left = stored.length
            while left:
                n = f.readinto(memoryview(buf)[: min(step, left)])
                if n == 0:
                    raise CheckpointError(f"{stored.shard}: truncated inside tensor '{name}'")
                chunk = memoryview(buf)[:n]
                if stored.dtype != dst:
                    chunk = torch.frombuffer(chunk, dtype=stored.dtype).to(dst).view(torch.uint8).numpy().data
                self.f.write(chunk)
                self.offset += len(chunk)
                left -= n
                if self.on_copy is not None:
                    self.on_copy(n)

    def write_tensor(self, name: str, value: torch.Tensor) -> TensorProto:
        return self.write_raw(
            name,
            ONNX_DTYPES[value.dtype],
            tuple(value.shape),
            value.contiguous().view(torch.uint8).numpy().tobytes(),
        )

    def externalize(self, t: TensorProto) -> None:
        """Move an in-proto tensor (the head's small constants) into the file, in place."""
        data = onnx.numpy_helper.to_array(t)
        t.CopyFrom(self.write_raw(t.name, t.data_type, tuple(t.dims), np.ascontiguousarray(data).tobytes()))

    def write_raw(self, name: str, data_type: int, shape: tuple[int, ...], data: bytes) -> TensorProto:
        start = self._begin()
        self.f.write(data)
        self.offset += len(data)
        return self._initializer(name, data_type, shape, start)

    def close(self) -> None:
        self.f.close()


def meta_model(config: ModelConfig, dtype: torch.dtype) -> DiffusionGemma:
    """The network's structure on the meta device, RoPE tables as (persistent) buffers so they trace as inputs."""
    with torch.device("meta"):
        model = DiffusionGemma(config).to(dtype)
    for kind in sorted(set(model.layer_types)):
        name = f"inv_freq_{kind}"
        model.register_buffer(name, getattr(model, name).float(), persistent=True)
    return model


def export_streaming(
    ckpt_dir: Path,
    out_dir: Path,
    *,
    dtype: torch.dtype | None = None,
    moe: str = onnx_io.DEFAULT_MOE,
    progress: Callable[[int, int], None] | None = None,  # (bytes done, bytes total)
) -> ExportSummary:
    """Export a float checkpoint to out_dir (model.onnx + model.onnx.data + contract.json), atomically,
    streaming the weights. `dtype`: the graph's model dtype (default: the checkpoint's stored dtype)."""
    start = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    if moe not in onnx_io.MOE_FORMS:
        raise DgpipeError(f"unknown MoE form '{moe}'", f"choose one of: {', '.join(onnx_io.MOE_FORMS)}")
    stored = _stored_weights(ckpt_dir)
    dtype = dtype or next(iter(stored.values()))[1].dtype
    if dtype not in MODEL_DTYPES:
        raise DgpipeError(f"cannot export a {dtype} graph", "use float32, bfloat16 or float16")
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    model = meta_model(open_checkpoint(ckpt_dir).config, dtype)
    m, weights = _trace(model, moe)
    return _write(ckpt_dir, out_dir, m, weights, model, stored, dtype, precision, moe, progress, start)


def export_quantized_streaming(
    ckpt_dir: Path,
    out_dir: Path,
    fmt: str,
    *,
    dtype: torch.dtype = torch.float32,
    moe: str = onnx_io.DEFAULT_MOE,
    progress: Callable[[int, int], None] | None = None,  # (bytes done, bytes total)
) -> ExportSummary:
    """A ModelOpt FP8 or NVFP4 checkpoint (`fmt`) as its Q/DQ graph in the model dtype `dtype`, the graph
    `pipeline.onnx.quant.export_fp8` / `export_nvfp4` write, without loading the model: host memory is the
    traced graph, the per-tensor scales and one chunk."""
    from pipeline.onnx import quant as q

    start = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    if moe not in onnx_io.MOE_FORMS:
        raise DgpipeError(f"unknown MoE form '{moe}'", f"choose one of: {', '.join(onnx_io.MOE_FORMS)}")
    quant = q.check_exportable(stored_packed_linears(ckpt_dir), ckpt_dir, fmt)
    model = meta_model(open_checkpoint(ckpt_dir).config, dtype)
    trace = q.QuantizedTrace.of(model, quant, fmt, moe, dtype, meta=True)
    form = "routed" if trace.routed else "dense"
    with tempfile.TemporaryDirectory() as scratch:
        m = trace_network(
            model, Path(scratch) / "net.onnx", trace.linear(model), trace.holder, form, trace.experts
        )
    m = onnx.version_converter.convert_version(m, onnx_io.OPSET)

    def post(m: onnx.ModelProto, writer: ExternalDataWriter) -> None:  # the Q/DQ, copied from the shards
        trace.insert(m, model, quant, *q.INSERTS[fmt], inits=Streamed(m, writer))

    stored = _stored_weights(ckpt_dir, packed=True)
    return _write(
        ckpt_dir, out_dir, m, _weight_inputs(m, model), model, stored, dtype, fmt, form, progress, start,
        post=post, skip=trace.stand_ins, values=trace.values, packed_bytes=_packed_bytes(quant),
    )  # fmt: skip


def _packed_bytes(quant: dict[str, Any]) -> int:
    """What the Q/DQ insertion copies from the shards (the progress total beside the float weights)."""
    return sum(
        t.length for lin in quant.values() for t in (lin.weight, lin.weight_scale) if isinstance(t, Stored)
    )


def _stored_weights(ckpt_dir: Path, packed: bool = False) -> dict[str, tuple[str, Stored]]:
    """runtime name -> (checkpoint name, where its bytes are), from the shards' headers."""
    stored = {}
    for shard in sorted(set(weight_files(ckpt_dir).values())):
        for name, (src, shape, off, length) in safetensors_index(shard, packed).items():
            target = runtime_name(name)
            if target is not None:
                stored[target] = (name, Stored(shard, src, shape, off, length))
    if not stored:
        raise CheckpointError(f"{ckpt_dir}: no DiffusionGemma tensors (expected names under '{DECODER}')")
    return stored


def _write(
    ckpt_dir: Path,
    out_dir: Path,
    m: onnx.ModelProto,
    weights: list[onnx.ValueInfoProto],
    model: DiffusionGemma,
    stored: dict[str, tuple[str, Stored]],
    dtype: torch.dtype,
    precision: str,
    moe: str,
    progress: Callable[[int, int], None] | None,
    start: float,
    *,
    post: Callable[[onnx.ModelProto, ExternalDataWriter], None] | None = None,
    skip: set[str] = frozenset(),  # type: ignore[assignment]
    values: dict[str, torch.Tensor] | None = None,
    packed_bytes: int = 0,
) -> ExportSummary:
    """Bind the traced weight inputs to their tensors in the shards (copied into the external data, dtype
    converted), or to `values`, leaving out the `skip` stand-ins `post` replaces; then the head, the
    sampler, the contract and the checks, into out_dir atomically."""
    from pipeline.atomic import atomic_dir

    values, out_dir = values or {}, Path(out_dir)
    graph_inputs = {i.name for i in m.graph.input} - {w.name for w in weights}
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    bound = [w for w in weights if w.name not in skip and w.name not in values]
    experts = {w.name: _per_expert(stored, _param(w.name), shapes) for w in bound}
    total = packed_bytes + sum(
        sum(p.length for p in parts) if parts else stored[_param(w.name)][1].length
        for w in bound
        if (parts := experts[w.name]) or _param(w.name) in stored
    )
    done = 0

    def copied(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    with atomic_dir(out_dir, onnx_io.EXPORT_KIND, onnx_io.CONTRACT_FILE) as tmp:
        writer = ExternalDataWriter(tmp / onnx_io.WEIGHTS_FILE, on_copy=copied)
        try:
            inits = [writer.write_tensor(name, v) for name, v in values.items()]
            for vi in bound:
                param = _param(vi.name)
                if param.startswith("inv_freq_"):  # not a weight: rebuilt from the config, as load_model does
                    kind = param[len("inv_freq_") :]
                    hd = model.cfg.layer_shape(model.layer_types.index(kind)).head_dim
                    inits.append(writer.write_tensor(vi.name, rope_inv_freq(model.cfg, kind, hd).float()))
                    continue
                if experts[vi.name]:  # a quantized checkpoint's unquantized experts, stored one by one
                    onnx_type = ONNX_DTYPES[dtype]
                    inits.append(
                        writer.copy_parts(vi.name, onnx_type, shapes[param], experts[vi.name], dtype)
                    )
                    continue
                src = stored.get(param)
                if src is None and param.endswith(
                    "encoder_layer_scalar"
                ):  # as load_model: the decoder's copy
                    src = stored.get(param.replace("encoder_layer_scalar", "layer_scalar"))
                if src is None:
                    raise CheckpointError(
                        f"{ckpt_dir}: tensor '{DECODER}{param}' is missing from the weights"
                    )
                name, st = src
                if tuple(st.shape) != shapes[param]:
                    raise CheckpointError(
                        f"{st.shard}: tensor '{name}' has shape {tuple(st.shape)}, config.json implies {shapes[param]}"
                    )
                inits.append(writer.copy_parts(vi.name, ONNX_DTYPES[dtype], st.shape, [st], dtype))
            if post is not None:  # the Q/DQ insertion (NVFP4 raises the opset to 23)
                post(m, writer)
        finally:
            writer.close()
        keep = [i for i in m.graph.input if i.name in graph_inputs]
        del m.graph.input[:]
        m.graph.input.extend(keep)
        m.graph.initializer.extend(inits)
        contract = finish_graph(m, model, MODEL_DTYPES[dtype], precision, moe, check=False)
        writer = ExternalDataWriter(tmp / onnx_io.WEIGHTS_FILE, append=True)
        try:  # the head's constants too: every initializer external, as export_onnx writes them
            for t in m.graph.initializer:
                if t.data_location != TensorProto.EXTERNAL:
                    writer.externalize(t)
        finally:
            writer.close()
        onnx.save_model(m, str(tmp / onnx_io.MODEL_FILE))  # graph only: every tensor is external already
        onnx.checker.check_model(str(tmp / onnx_io.MODEL_FILE))  # by path: resolves the external data
        record_pass_cost(contract, tmp / onnx_io.MODEL_FILE, model)
        (tmp / onnx_io.CONTRACT_FILE).write_text(json.dumps(contract, indent=2) + "\n")
    return summarize(m, out_dir, contract, start)


def _per_expert(
    stored: dict[str, tuple[str, Stored]], param: str, shapes: dict[str, tuple[int, ...]]
) -> list[Stored] | None:
    """A fused expert parameter (`layers.N.experts.gate_up_proj` [E, 2I, d], `down_proj` [E, d, I]) that the
    checkpoint stores one tensor per expert and projection (ModelOpt's export, also for experts it left
    unquantized): the tensors in the fused order (expert by expert, gate before up); None when the checkpoint
    stores it fused, or the parameter is no expert's."""
    m = re.fullmatch(r"(layers\.\d+\.experts)\.(gate_up_proj|down_proj)", param)
    if m is None or param in stored:
        return None
    projections = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
    names = [f"{m.group(1)}.{e}.{p}.weight" for e in range(shapes[param][0]) for p in projections]
    if not all(n in stored for n in names):
        return None
    parts = [stored[n][1] for n in names]
    if sum(math.prod(p.shape) for p in parts) != math.prod(shapes[param]):
        raise CheckpointError(f"{parts[0].shard}: the experts of '{m.group(1)}' do not make {shapes[param]}")
    return parts


def _weight_inputs(m: onnx.ModelProto, model: DiffusionGemma) -> list[onnx.ValueInfoProto]:
    """The traced graph's inputs that are weights (to bind), not the model's own inputs."""
    graph_inputs = {s.name for s in (*onnx_io.MODEL_INPUTS, *onnx_io.kv_inputs(list(model.layer_types)))}
    return [i for i in m.graph.input if i.name not in graph_inputs]


def _trace(model: DiffusionGemma, moe: str) -> tuple[onnx.ModelProto, list[onnx.ValueInfoProto]]:
    """Meta trace at the contract opset; the weight inputs (to bind) separately."""
    with tempfile.TemporaryDirectory() as scratch:
        m = trace_network(model, Path(scratch) / "net.onnx", moe=moe)
    m = onnx.version_converter.convert_version(m, onnx_io.OPSET)
    return m, _weight_inputs(m, model)


def structure_graph(config: ModelConfig, moe: str, dtype: torch.dtype = torch.bfloat16) -> onnx.ModelProto:
    """The full exported graph of `config` WITHOUT weights (initializers carry dims and an external location
    that is never written): what `pipeline.onnx.flops` counts for a model too large to export here."""
    model = meta_model(config, dtype)
    m, weights = _trace(model, moe)
    names = {w.name for w in weights}
    inits = []
    for w in weights:
        t = TensorProto(name=w.name, data_type=w.type.tensor_type.elem_type)
        t.dims.extend(d.dim_value for d in w.type.tensor_type.shape.dim)
        t.data_location = TensorProto.EXTERNAL
        entry = t.external_data.add()
        entry.key, entry.value = "location", onnx_io.WEIGHTS_FILE
        inits.append(t)
    keep = [i for i in m.graph.input if i.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.extend(inits)
    finish_graph(m, model, MODEL_DTYPES[dtype], "structure", moe, check=False)
    return m


def _param(graph_name: str) -> str:
    return graph_name[len(GRAPH_PREFIX) :] if graph_name.startswith(GRAPH_PREFIX) else graph_name
