"""The engine's TensorRT ahead-of-time Python plugins: the sampler (`dgpipe::SampleRows`,
`dgpipe::SampleAccept`) and the routed experts (`dgpipe::MoEExperts`, `...W8`, `...W8A8`, `...W4`, `...W4A4`;
moe_spec).

Why AOT Python plugins (tensorrt.plugin, TensorRT >= 10.9) and not a C++ IPluginV3 library: `@trtp.aot_impl`
returns PTX that TensorRT embeds in the serialized engine, so the plan is self-contained: Triton's C++
runtime, trtexec or our Python wrapper run it with no plugin .so to build per TensorRT version and CUDA
arch, ship, and load (`--backend-config=tensorrt,plugins=...`, LD_PRELOAD), and no NvInfer.h (absent from
the pip wheels). Python is needed at build time only. The cost: one kernel per plugin and no custom
tactics, which is why the sampler is two nodes, one per kernel.

Each `@trtp.register` function checks the inputs and describes the outputs with the rules of
`pipeline.engine.plugin_spec` / `moe_spec`, whose port lists also make the functions' signatures
(`_define_plugin`); each `@trtp.aot_impl` returns (kernel name, PTX, launch params, extra int32
args) for the `dg_trt_*` entry points of csrc/dg_sampler.cu, whose parameters follow TensorRT's AOT calling
convention: input pointers, the extra scalars (length, vocab), output pointers.

`register(ptx, arch)` must run before the ONNX parser sees the nodes; TensorRT is imported here only.
"""

import inspect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.engine import plugin_spec as spec
from pipeline.errors import DgpipeError

_STATE: dict[str, Any] = {"ptx": None, "arch": None, "registered": False}


def _dtype_names(trt: Any) -> dict[Any, str]:
    return {
        trt.float32: "float32",
        trt.bfloat16: "bfloat16",
        trt.int64: "int64",
        trt.bool: "bool",
        trt.fp8: "float8e4m3",
        trt.fp4: "float4e2m1",  # NVFP4 expert weights: packed two per byte, dims count elements
    }


def _trt_dtypes(trt: Any) -> dict[str, Any]:
    return {v: k for k, v in _dtype_names(trt).items()}


def _const(expr: Any) -> int | None:
    """A build-time constant dimension, else None (dynamic, or a placeholder outside shape contexts)."""
    if getattr(expr, "is_fake", False) or not expr.is_constant:
        return None
    return int(expr.constant_value())


def set_ptx(ptx: bytes | str, arch: str) -> None:
    """The PTX the AOT implementations return (one target's, from `pipeline.engine.ptx`)."""
    _STATE["ptx"] = ptx.encode() if isinstance(ptx, str) else ptx
    _STATE["arch"] = arch


def _ptx() -> bytes:
    if _STATE["ptx"] is None:
        raise DgpipeError("the engine plugins have no PTX: call pipeline.engine.plugin.set_ptx first")
    return _STATE["ptx"]


def register(ptx: bytes | str | Path, arch: str) -> None:
    """Register every plugin with TensorRT's plugin registry (idempotent) and set the PTX to embed."""
    if isinstance(ptx, Path):
        ptx = ptx.read_bytes()
    set_ptx(ptx, arch)
    if _STATE["registered"]:
        return
    _define()
    _define_moe()
    _STATE["registered"] = True


def _define_plugin(
    trtp: Any,
    op: str,
    ports: tuple,
    n_outputs: int,
    describe: Callable[..., tuple],
    launch: Callable[..., tuple],
    attrs: dict[str, type] | None = None,
) -> None:
    """Register `NAMESPACE::op` with TensorRT: its `@trtp.register` and `@trtp.aot_impl` functions.

    tensorrt.plugin reads a plugin's inputs and attributes from the decorated functions' signatures (names,
    annotations, order: `_validate.py` calls `inspect.signature`), so the signatures are made here from the
    op's port list in plugin_spec / moe_spec, where the ports are written once. TensorRT calls the register
    function with the inputs positionally and the attributes by keyword, and the AOT function with all of
    them positionally, then the output descriptions and the tactic.
    describe(inputs, **attrs) -> output descriptions; launch(inputs, **attrs) -> (kernel, PTX, launch, extra).
    """
    from typing import Tuple, Union  # noqa: UP035  (the annotations tensorrt.plugin validates)

    attrs = attrs or {}
    td = trtp.TensorDesc
    arg = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(p.name, arg, annotation=td) for p in ports]
    params += [inspect.Parameter(name, arg, annotation=kind) for name, kind in attrs.items()]
    n = len(ports)

    def register_fn(*inputs: Any, **attr_values: Any) -> tuple:
        return describe(inputs, **attr_values)

    def aot_fn(*args: Any) -> tuple:
        return launch(args[:n], **dict(zip(attrs, args[n:-2])))  # the last two: outputs, tactic

    register_fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        params,
        return_annotation=Tuple[(td,) * n_outputs],  # noqa: UP006
    )
    aot_fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*params, inspect.Parameter("outputs", arg), inspect.Parameter("tactic", arg, annotation=int)],
        return_annotation=Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs],  # noqa: UP006, UP007
    )
    plugin_id = f"{spec.NAMESPACE}::{op}"
    trtp.register(plugin_id)(register_fn)
    trtp.aot_impl(plugin_id)(aot_fn)


def _define() -> None:
    """The sampler's two plugins: kernel A (`SampleRows`) and kernel B (`SampleAccept`) of csrc/dg_sampler.cu."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    names, types = _dtype_names(trt), _trt_dtypes(trt)

    def check(op: str, inputs: tuple) -> None:
        spec.check_inputs(op, [names.get(t.dtype, str(t.dtype)) for t in inputs], [t.ndim for t in inputs])

    def describe(op: str, b: Any, length: Any, vocab: Any) -> tuple:
        return tuple(
            trtp.from_shape_expr(shape, dtype=types[dtype])
            for shape, dtype in spec.output_shapes(op, b, length, vocab)
        )

    def rows_desc(inputs: tuple) -> tuple:
        check(spec.ROWS_OP, inputs)
        s = inputs[0].shape_expr  # logits [B, L, V]
        return describe(spec.ROWS_OP, s[0], s[1], s[2])

    def rows_aot(inputs: tuple) -> tuple:
        logits = inputs[0]
        s = logits.shape_expr
        kernel = spec.rows_kernel(names[logits.dtype], _const(s[2]))
        launch = trtp.KernelLaunchParams()
        launch.grid_x = s[0] * s[1]  # one block per (row, position)
        launch.block_x = spec.ROW_THREADS
        launch.shared_mem = 0  # static shared memory only
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(s[1])  # length
        extra[1] = trtp.SymInt32(s[2])  # vocab
        return kernel.encode(), _ptx(), launch, extra

    def accept_desc(inputs: tuple, vocab: int) -> tuple:
        spec.check_vocab(vocab)
        check(spec.ACCEPT_OP, inputs)
        s = inputs[0].shape_expr  # entropy [B, L]
        return describe(spec.ACCEPT_OP, s[0], s[1], None)

    def accept_aot(inputs: tuple, vocab: int) -> tuple:
        s = inputs[0].shape_expr
        launch = trtp.KernelLaunchParams()
        launch.grid_x = s[0]  # one block per row
        launch.block_x = spec.accept_block(_const(s[1]))
        launch.shared_mem = 0
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(s[1])  # length
        extra[1] = trtp.SymInt32(vocab)  # the node's attribute: re-noise tokens are drawn from [0, vocab)
        return spec.ACCEPT_KERNEL.encode(), _ptx(), launch, extra

    rows_in, rows_out = spec.SPECS[spec.ROWS_OP]
    _define_plugin(trtp, spec.ROWS_OP, rows_in, len(rows_out), rows_desc, rows_aot)
    accept_in, accept_out = spec.SPECS[spec.ACCEPT_OP]
    _define_plugin(
        trtp, spec.ACCEPT_OP, accept_in, len(accept_out), accept_desc, accept_aot, spec.ACCEPT_ATTRS
    )


def _define_moe() -> None:
    """The routed-experts plugins (pipeline.engine.moe_spec): one fp32 row per (token, choice), out_k
    [T, K, d]; the graph sums over K and casts (pipeline.engine.moe_graph). All dims but T are weight
    shapes, so build-time constants: the tile and shared memory are fixed per engine."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from pipeline.engine import moe_spec as moe

    names = _dtype_names(trt)

    def describe(op: str, inputs: tuple) -> tuple:
        moe.check_inputs(op, [names.get(t.dtype, str(t.dtype)) for t in inputs], [t.ndim for t in inputs])
        h, idx = inputs[0].shape_expr, inputs[1].shape_expr
        return (trtp.from_shape_expr((h[0], idx[1], h[1]), dtype=trt.float32),)

    def launch(op: str, inputs: tuple) -> tuple:
        hidden, index, gate_up = inputs[0], inputs[1], inputs[3]
        down = inputs[moe.port_index(op, "down")]
        dims = {}
        for label, exprs in (
            ("d", hidden.shape_expr[1:]),
            ("gate_up", gate_up.shape_expr),
            ("down", down.shape_expr),
        ):
            values = tuple(_const(e) for e in exprs)
            if None in values:
                raise DgpipeError(
                    f"{spec.NAMESPACE}::{op}: the {label} dims must be build-time constants (weights, hidden size)"
                )
            dims[label] = values
        d, experts = dims["d"][0], dims["gate_up"][0]
        inter = moe.check_dims(op, d, experts, dims["gate_up"], dims["down"])
        if op != moe.EXPERTS_OP:  # the scale inputs, in port order
            scales = [t for t, port in zip(inputs, moe.SPECS[op]) if port.name.endswith("scale")]
            shapes = [tuple(_const(e) for e in t.shape_expr) for t in scales]
            moe.check_scales(op, d, experts, shapes, inter)
        x_dtype = names[hidden.dtype]
        kernel = moe.kernel(op, x_dtype)
        n = moe.tile(d, inter, x_dtype)
        tokens = hidden.shape_expr[0]
        p = trtp.KernelLaunchParams()
        p.grid_x = experts  # one block column per expert ...
        p.grid_y = trtp.min(trtp.cdiv(tokens, moe.TOKENS_PER_SPLIT), moe.MAX_SPLITS)  # ... per token split
        p.block_x = moe.THREADS
        p.shared_mem = moe.shared_bytes(d, inter, x_dtype, n)
        extra = trtp.SymIntExprs(6)
        for i, v in enumerate((tokens, index.shape_expr[1], d, inter, experts, n)):
            extra[i] = trtp.SymInt32(v)
        return kernel.encode(), _ptx(), p, extra

    for op, ports in moe.SPECS.items():
        _define_plugin(trtp, op, ports, 1, partial(describe, op), partial(launch, op))
