"""The sampler as TensorRT ahead-of-time Python plugins: `dgpipe::SampleRows` and `dgpipe::SampleAccept`.

Why AOT Python plugins (tensorrt.plugin, TensorRT >= 10.8) and not a C++ IPluginV3 library: `@trtp.aot_impl`
returns PTX that TensorRT embeds in the serialized engine, so the plan is self-contained: Triton's C++
runtime, trtexec or our Python wrapper run it with no plugin .so to build per TensorRT version and CUDA
arch, ship, and load (`--backend-config=tensorrt,plugins=...`, LD_PRELOAD), and no NvInfer.h (absent from
the pip wheels). Python is needed at build time only. The cost: one kernel per plugin and no custom
tactics, which is why the sampler is two nodes, one per kernel.

Each `@trtp.register` function checks the inputs and describes the outputs with the rules of
`pipeline.engine.plugin_spec`; each `@trtp.aot_impl` returns (kernel name, PTX, launch params, extra int32
args) for the `dg_trt_*` entry points of csrc/dg_sampler.cu, whose parameters follow TensorRT's AOT calling
convention: input pointers, the extra scalars (length, vocab), output pointers.

`register(ptx, arch)` must run before the ONNX parser sees the nodes; TensorRT is imported here only.
No `from __future__ import annotations` here: tensorrt.plugin reads the decorated functions' annotations as
objects (TensorDesc, int, Tuple[...]) to build the plugin signature, and strings would not match.
"""

from pathlib import Path
from typing import Any

from pipeline.engine import plugin_spec as spec
from pipeline.errors import DgpipeError

_STATE: dict[str, Any] = {"ptx": None, "arch": None, "registered": False}


def _dtype_names(trt: Any) -> dict[Any, str]:
    return {trt.float32: "float32", trt.bfloat16: "bfloat16", trt.int64: "int64", trt.bool: "bool"}


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
        raise DgpipeError("the sampler plugin has no PTX: call pipeline.engine.plugin.set_ptx first")
    return _STATE["ptx"]


def register(ptx: bytes | str | Path, arch: str) -> None:
    """Register both plugins with TensorRT's plugin registry (idempotent) and set the PTX to embed."""
    if isinstance(ptx, Path):
        ptx = ptx.read_bytes()
    set_ptx(ptx, arch)
    if _STATE["registered"]:
        return
    _define()
    _STATE["registered"] = True


def _define() -> None:
    # typing.Tuple / Union as in TensorRT's own samples: tensorrt.plugin validates these annotations
    from typing import Tuple, Union  # noqa: UP035

    import tensorrt as trt
    import tensorrt.plugin as trtp

    names, types = _dtype_names(trt), _trt_dtypes(trt)

    def check(op: str, *inputs: Any) -> None:
        spec.check_inputs(op, [names.get(t.dtype, str(t.dtype)) for t in inputs], [t.ndim for t in inputs])

    def describe(op: str, b: Any, length: Any, vocab: Any) -> tuple:
        return tuple(
            trtp.from_shape_expr(shape, dtype=types[dtype])
            for shape, dtype in spec.output_shapes(op, b, length, vocab)
        )

    rows_id = f"{spec.NAMESPACE}::{spec.ROWS_OP}"
    accept_id = f"{spec.NAMESPACE}::{spec.ACCEPT_OP}"
    TD = trtp.TensorDesc
    Out = Tuple[  # noqa: UP006
        TD, TD, TD, TD, TD
    ]
    Out6 = Tuple[  # noqa: UP006
        TD, TD, TD, TD, TD, TD
    ]
    Aot = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]  # noqa: UP006, UP007

    @trtp.register(rows_id)
    def rows_desc(logits: TD, temperature: TD, seed: TD, request: TD, canvas: TD, step: TD) -> Out:
        check(spec.ROWS_OP, logits, temperature, seed, request, canvas, step)
        s = logits.shape_expr
        return describe(spec.ROWS_OP, s[0], s[1], s[2])

    @trtp.aot_impl(rows_id)
    def rows_aot(
        logits: TD, temperature: TD, seed: TD, request: TD, canvas: TD, step: TD, outputs, tactic: int
    ) -> Aot:
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

    @trtp.register(accept_id)
    def accept_desc(
        entropy: TD,
        argmax: TD,
        sample: TD,
        template: TD,
        bound: TD,
        seed: TD,
        request: TD,
        canvas: TD,
        step: TD,
        prev_argmax: TD,
        stable_count: TD,
        stability_threshold: TD,
        confidence_threshold: TD,
        vocab: int,
    ) -> Out6:
        spec.check_vocab(vocab)
        check(
            spec.ACCEPT_OP,
            entropy,
            argmax,
            sample,
            template,
            bound,
            seed,
            request,
            canvas,
            step,
            prev_argmax,
            stable_count,
            stability_threshold,
            confidence_threshold,
        )
        s = entropy.shape_expr
        return describe(spec.ACCEPT_OP, s[0], s[1], None)

    @trtp.aot_impl(accept_id)
    def accept_aot(
        entropy: TD,
        argmax: TD,
        sample: TD,
        template: TD,
        bound: TD,
        seed: TD,
        request: TD,
        canvas: TD,
        step: TD,
        prev_argmax: TD,
        stable_count: TD,
        stability_threshold: TD,
        confidence_threshold: TD,
        vocab: int,
        outputs,
        tactic: int,
    ) -> Aot:
        s = entropy.shape_expr
        launch = trtp.KernelLaunchParams()
        launch.grid_x = s[0]  # one block per row
        launch.block_x = spec.accept_block(_const(s[1]))
        launch.shared_mem = 0
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(s[1])  # length
        extra[1] = trtp.SymInt32(vocab)  # the node's attribute: re-noise tokens are drawn from [0, vocab)
        return spec.ACCEPT_KERNEL.encode(), _ptx(), launch, extra
