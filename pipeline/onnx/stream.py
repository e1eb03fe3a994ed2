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

Scope: float checkpoints (fp32/bf16/fp16) in the transformers layout. ModelOpt FP8/NVFP4 checkpoints still
go through `pipeline.onnx.quant` (in memory): their Q/DQ insertion rewrites initializers by value.
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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
ONNX_DTYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float16: TensorProto.FLOAT16,
}


def safetensors_index(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, absolute byte offset, byte length) from one shard's header."""
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
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor '{name}' is {info['dtype']}", "quantized checkpoints export in memory"
            )
        begin, end = info["data_offsets"]
        out[name] = (SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + begin, end - begin)
    return out


class ExternalDataWriter:
    """Appends tensors to one external-data file and returns initializers that point at them."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.f = open(path, "ab" if append else "wb")  # noqa: SIM115 - closed by close()
        self.offset = self.f.tell()
        self.buf: bytearray | None = None

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

    def copy_from_shard(
        self,
        name: str,
        shard: Path,
        src: torch.dtype,
        shape: tuple[int, ...],
        offset: int,
        length: int,
        dst: torch.dtype,
    ) -> TensorProto:
        """Copy one stored tensor chunk by chunk, converting src -> dst dtype; never holds more than CHUNK."""
        start = self._begin()
        item = torch.empty((), dtype=src).element_size()
        step = CHUNK - CHUNK % item
        if self.buf is None:
            self.buf = bytearray(
                CHUNK
            )  # one buffer for the whole export: allocating per tensor costs a memset
        buf = self.buf
        with open(shard, "rb") as f:
            f.seek(offset)
            left = length
            while left:
                n = f.readinto(memoryview(buf)[: min(step, left)])
                if n == 0:
                    raise CheckpointError(f"{shard}: truncated inside tensor '{name}'")
                chunk = memoryview(buf)[:n]
                if src != dst:
                    chunk = torch.frombuffer(chunk, dtype=src).to(dst).view(torch.uint8).numpy().data
                self.f.write(chunk)
                self.offset += len(chunk)
                left -= n
        return self._initializer(name, ONNX_DTYPES[dst], shape, start)

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
    from pipeline.atomic import atomic_dir

    start = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    if moe not in onnx_io.MOE_FORMS:
        raise DgpipeError(f"unknown MoE form '{moe}'", f"choose one of: {', '.join(onnx_io.MOE_FORMS)}")
    files = weight_files(ckpt_dir)
    stored = {}  # runtime name -> (checkpoint name, shard, dtype, shape, offset, length)
    for shard in sorted(set(files.values())):
        for name, (src, shape, off, length) in safetensors_index(shard).items():
            target = runtime_name(name)
            if target is not None:
                stored[target] = (name, shard, src, shape, off, length)
    if not stored:
        raise CheckpointError(f"{ckpt_dir}: no DiffusionGemma tensors (expected names under '{DECODER}')")
    dtype = dtype or next(iter(stored.values()))[2]
    if dtype not in MODEL_DTYPES:
        raise DgpipeError(f"cannot export a {dtype} graph", "use float32, bfloat16 or float16")
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    model = meta_model(open_checkpoint(ckpt_dir).config, dtype)
    m, weights = _trace(model, moe)
    graph_inputs = {i.name for i in m.graph.input} - {w.name for w in weights}
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    total = sum(stored[_param(i.name)][5] for i in weights if _param(i.name) in stored)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, onnx_io.EXPORT_KIND, onnx_io.CONTRACT_FILE) as tmp:
        writer = ExternalDataWriter(tmp / onnx_io.WEIGHTS_FILE)
        try:
            done = 0
            inits = []
            for vi in weights:
                param = _param(vi.name)
                if param.startswith("inv_freq_"):  # not a weight: rebuilt from the config, as load_model does
                    kind = param[len("inv_freq_") :]
                    hd = model.cfg.layer_shape(model.layer_types.index(kind)).head_dim
                    inits.append(writer.write_tensor(vi.name, rope_inv_freq(model.cfg, kind, hd).float()))
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
                name, shard, sdtype, shape, off, length = src
                if tuple(shape) != shapes[param]:
                    raise CheckpointError(
                        f"{shard}: tensor '{name}' has shape {tuple(shape)}, config.json implies {shapes[param]}"
                    )
                inits.append(writer.copy_from_shard(vi.name, shard, sdtype, shape, off, length, dtype))
                done += length
                if progress is not None:
                    progress(done, total)
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


def _trace(model: DiffusionGemma, moe: str) -> tuple[onnx.ModelProto, list[onnx.ValueInfoProto]]:
    """Meta trace at the contract opset; the weight inputs (to bind) separately."""
    with tempfile.TemporaryDirectory() as scratch:
        m = trace_network(model, Path(scratch) / "net.onnx", moe=moe)
    m = onnx.version_converter.convert_version(m, onnx_io.OPSET)
    graph_inputs = {s.name for s in (*onnx_io.MODEL_INPUTS, *onnx_io.kv_inputs(list(model.layer_types)))}
    return m, [i for i in m.graph.input if i.name not in graph_inputs]


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
