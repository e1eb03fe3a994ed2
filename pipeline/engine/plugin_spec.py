"""The sampler plugins' contract in plain Python: I/O, shape and type rules, kernel choice, launch geometry.

`pipeline.engine.plugin` wraps these for `tensorrt.plugin` (`@trtp.register` / `@trtp.aot_impl`); keeping
the rules here means a machine without TensorRT can test them, and the ONNX export and the TensorRT plugin
read one definition of the two nodes (ONNX domain `dgpipe`, version 1):

* `dgpipe::SampleRows` (kernel A, one block per (row, position)): entropy, max probability, argmax, Gumbel
  sample of z = logits / T, and softmax(z) in bf16 for the next step's self-conditioning.
* `dgpipe::SampleAccept` (kernel B, one block per row): entropy-bound acceptance, next canvas, argmax canvas
  with the template pinned, stability counter, stop flag.

Port order and dtypes mirror `rows` / `accept` in csrc/torch_binding.cpp, and the kernel parameter order
of the `dg_trt_*` entry points in csrc/dg_sampler.cu is (inputs, length, vocab, outputs): TensorRT's AOT
calling convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.errors import DgpipeError

NAMESPACE = "dgpipe"
ROWS_OP = "SampleRows"
ACCEPT_OP = "SampleAccept"
ROW_THREADS = 512  # kRowThreads in dg_sampler.cu
MAX_CANVAS = 1024  # kMaxCanvas: kernel B sorts one row in one block

DType = Literal["float32", "bfloat16", "int64", "bool", "float8e4m3", "float4e2m1"]


@dataclass(frozen=True)
class Port:
    name: str
    dtype: DType | tuple[DType, ...]  # a tuple: any of these
    dims: tuple[str, ...]  # symbolic: B rows, L positions, V vocabulary


ROWS_INPUTS = (
    Port("logits", ("float32", "bfloat16"), ("B", "L", "V")),
    Port("temperature", "float32", ("B",)),
    Port("seed", "int64", ("B",)),
    Port("request", "int64", ("B",)),
    Port("canvas", "int64", ("B",)),
    Port("step", "int64", ("B",)),
)
ROWS_OUTPUTS = (
    Port("entropy", "float32", ("B", "L")),
    Port("max_prob", "float32", ("B", "L")),
    Port("argmax", "int64", ("B", "L")),
    Port("sample", "int64", ("B", "L")),
    Port("probs", "bfloat16", ("B", "L", "V")),
)
ACCEPT_INPUTS = (
    Port("entropy", "float32", ("B", "L")),
    Port("argmax", "int64", ("B", "L")),
    Port("sample", "int64", ("B", "L")),
    Port("template", "int64", ("B", "L")),  # always present: -1 = free position
    Port("bound", "float32", ("B",)),
    Port("seed", "int64", ("B",)),
    Port("request", "int64", ("B",)),
    Port("canvas", "int64", ("B",)),
    Port("step", "int64", ("B",)),
    Port("prev_argmax", "int64", ("B", "L")),
    Port("stable_count", "int64", ("B",)),
    Port("stability_threshold", "int64", ("B",)),
    Port("confidence_threshold", "float32", ("B",)),
)
ACCEPT_OUTPUTS = (
    Port("entropy_out", "float32", ("B", "L")),
    Port("kept", "bool", ("B", "L")),
    Port("canvas_out", "int64", ("B", "L")),
    Port("argmax_out", "int64", ("B", "L")),
    Port("stable_out", "int64", ("B",)),
    Port("stop", "bool", ("B",)),
)
# attributes: SampleAccept needs the vocabulary size (the range of re-noise tokens), which none of its inputs
# carries; an AOT plugin reads attributes at build time only, so it becomes a constant kernel argument
ACCEPT_ATTRS = {"vocab": int}
SPECS = {ROWS_OP: (ROWS_INPUTS, ROWS_OUTPUTS), ACCEPT_OP: (ACCEPT_INPUTS, ACCEPT_OUTPUTS)}


def check_inputs(op: str, dtypes: list[str], ranks: list[int]) -> None:
    """Refuse a node whose inputs do not match the kernel's parameters (count, dtype, rank).

    TensorRT would otherwise launch the kernel on mistyped pointers: a wrong answer, not an error."""
    check_ports(op, SPECS[op][0], dtypes, ranks)


def check_ports(op: str, inputs: tuple[Port, ...], dtypes: list[str], ranks: list[int]) -> None:
    """`check_inputs` against an explicit port list (the MoE plugins' ports live in moe_spec)."""
    if len(dtypes) != len(inputs):
        raise DgpipeError(f"{NAMESPACE}::{op} takes {len(inputs)} inputs, the node has {len(dtypes)}")
    for port, dtype, rank in zip(inputs, dtypes, ranks, strict=True):
        allowed = port.dtype if isinstance(port.dtype, tuple) else (port.dtype,)
        if dtype not in allowed:
            raise DgpipeError(
                f"{NAMESPACE}::{op} input '{port.name}' must be {'|'.join(allowed)}, got {dtype}"
            )
        if rank != len(port.dims):
            raise DgpipeError(
                f"{NAMESPACE}::{op} input '{port.name}' must have rank {len(port.dims)}, got {rank}"
            )


def check_vocab(vocab: int) -> None:
    if not 1 <= vocab < 2**31:
        raise DgpipeError(f"{NAMESPACE}::{ACCEPT_OP} attribute vocab must be in [1, 2**31), got {vocab}")


def output_shapes(
    op: str, b: object, length: object, vocab: object
) -> list[tuple[tuple[object, ...], DType]]:
    """Each output's shape (in terms of the given B, L, V: ints or symbolic expressions) and dtype."""
    sizes = {"B": b, "L": length, "V": vocab}
    return [(tuple(sizes[d] for d in p.dims), p.dtype) for p in SPECS[op][1]]  # type: ignore[misc]


def rows_kernel(logits_dtype: str, vocab: int | None) -> str:
    """Kernel A entry point: 16-byte vector loads when every row starts 16-byte aligned (the vocabulary is a
    known multiple of the vector width; TensorRT tensors start 256-byte aligned), else the scalar variant."""
    if logits_dtype == "float32":
        return "dg_trt_rows_f32x4" if vocab is not None and vocab % 4 == 0 else "dg_trt_rows_f32x1"
    if logits_dtype == "bfloat16":
        return "dg_trt_rows_bf16x8" if vocab is not None and vocab % 8 == 0 else "dg_trt_rows_bf16x1"
    raise DgpipeError(f"{NAMESPACE}::{ROWS_OP}: logits must be float32 or bfloat16, got {logits_dtype}")


ACCEPT_KERNEL = "dg_trt_accept"


def accept_block(length: int | None) -> int:
    """Kernel B block size: the power of two >= the canvas length (>= one warp), or the largest the kernel
    supports when the length is only known at run time (the sort's padding sorts after every position, so that
    is exact; `plan_build` refuses longer canvases)."""
    if length is None:
        return MAX_CANVAS
    if not 1 <= length <= MAX_CANVAS:
        raise DgpipeError(f"{NAMESPACE}::{ACCEPT_OP}: canvas length {length} is outside [1, {MAX_CANVAS}]")
    block = 32
    while block < length:
        block <<= 1
    return block
