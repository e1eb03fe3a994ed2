"""Fake CUDA tensors on a machine without a GPU, for tracing dgpipe's CUDA path (`pipeline.bench.gpu.trace`).

torch's fake tensors carry shapes, dtypes and devices, no data, so a CUDA model of any size can run its
Python and its ops' shape functions anywhere. In a CPU build of torch a fake CUDA tensor works for most ops,
but the ops that need a CUDA device guard or generator (indexing, `copy_`, `sort`, random draws) raise "not
linked with support for cuda devices"; those run here on meta tensors of the same layout, and the result
becomes a fake CUDA tensor again (`_on_meta`). torch 2.13 has no meta function for `_scaled_grouped_mm_v2`;
one is registered for the 2-D x 3-D grouped form dgpipe calls. Triton kernels are not launched: their
launchers check that every tensor is on the GPU and count the launch. While counting, an operation that
reads a host tensor raises `HostTensorInPass`, and fake tensors themselves raise on any result that needs
the device's data (`.item()`, `.tolist()`, `torch.equal`, a data-dependent shape).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict
from collections.abc import Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from pipeline.model.network import DiffusionGemma
from pipeline.runtime import kernels, tensor_cores

CAPABILITY = {"sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
NO_CUDA = "not linked with support for cuda"  # a CPU build's error for a CUDA device guard or generator
# operations that launch no work on the device (views are recognised by their schema)
NO_WORK = frozenset(
    {"prim::device", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
     "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::_local_scalar_dense"}
)  # fmt: skip


def footprint(t: torch.Tensor) -> int:
    """Bytes of memory a tensor spans: its elements, or less where dimensions are broadcast (stride 0)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return min(t.numel(), span) * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


# ops that read only the rows their indices name: what they read is what they write, not their source
GATHERS = frozenset({"aten::embedding", "aten::index_select", "aten::index", "aten::gather"})


def traffic(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Bytes an op moves if it reads each operand and writes each result once (an in-place result counts as a
    write of its argument; a gather reads its indices and the rows it writes; `copy_` does not read what it
    overwrites)."""
    written = sum(footprint(t) for t in outputs)
    if name == "aten::copy_":
        inputs = inputs[1:]
    if name in GATHERS:
        return written + sum(footprint(t) for t in inputs[1:] if not t.is_floating_point()) + written
    return sum(footprint(t) for t in inputs) + written


class OpCounter(TorchDispatchMode):
    """Counts the pass's operations and the bytes each moves (`traffic`); runs on meta tensors the ops whose
    fake kernel needs a CUDA build."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake, self.ops, self.bytes, self.counting = fake, Counter(), Counter(), False
        self.compiles: defaultdict[str, set[tuple]] = defaultdict(set)  # each Triton kernel's launch keys

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if self.counting:
            _refuse_host_tensors(name, args, kwargs)
        out = self._run(func, args, kwargs)
        if name == "aten::scaled_dot_product_attention":
            out = _fused_attention_layout(out)
        if self.counting and name not in NO_WORK and not (func.is_view and _viewed(args, out)):
            self.ops[name] += 1
            self.bytes[name] += traffic(name, _tensors((args, kwargs)), _tensors(out))
        return out

    def _run(self, func, args, kwargs):
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if NO_CUDA not in str(e):
                raise
        if isinstance(kwargs.get("device"), torch.device | str):
            kwargs = {**kwargs, "device": "meta"}
        return _on_meta(self.fake, func, args, kwargs)


def _fused_attention_layout(out: torch.Tensor) -> torch.Tensor:
    """SDPA's result [B, H, Q, D] as torch's fused CUDA kernels (flash, memory-efficient, cuDNN) lay it out for
    queries transposed from [B, Q, H, D]: the transpose of a contiguous [B, Q, H, D], so attention's
    `out.transpose(1, 2).reshape(...)` is a view on the GPU. The fake kernel returns the math path's
    contiguous layout, which would count a copy the GPU never makes."""
    b, heads, n, d = out.shape
    return out.new_empty(b, n, heads, d).transpose(1, 2)


def _viewed(args, out) -> bool:
    """Whether an op whose schema may alias its input (`reshape`, `contiguous`, `flatten`: views where the
    strides allow, copies elsewhere) returned views of it: no work on the device."""
    source = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
    results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if source is None:
        return True
    storage = source.untyped_storage()._cdata
    return all(t.untyped_storage()._cdata == storage for t in results)


# ops and tensor methods that copy their input to the device (the methods are seen first: under inference
# mode a host tensor's copy is not dispatched to this module's modes)
HOST_COPIES = frozenset(
    {"aten::_to_copy", "aten::copy_", "torch.Tensor.to", "torch.Tensor.copy_", "torch.Tensor.cuda"}
)


class HostTensorInPass(RuntimeError):
    """A tensor that lives on the host entered the pass."""


def _refuse_host_tensors(name: str, args, kwargs) -> None:
    """Raise on a host tensor in the pass: copied to the GPU (`.to`, `copy_`) it is a host-to-device copy on
    every call, which a CUDA graph cannot capture; used by any other op but as a 0-dim scalar, the wrong
    device. (A 0-dim CPU tensor in arithmetic is a scalar, as CUDA kernels take it.)"""
    leaves = tree_leaves((args, kwargs))
    real = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)]
    host = [t for t in real if t.device.type == "cpu"]  # (meta: this module's own stand-ins)
    if host and (name in HOST_COPIES or any(t.dim() > 0 for t in host)):
        t = host[0]
        raise HostTensorInPass(f"{name} reads a {t.device.type} tensor of shape {list(t.shape)}")


class _Functions(TorchFunctionMode):
    """Python-bound tensor methods that set a CUDA device guard before any dispatch (indexing, `copy_`,
    `contiguous`, `sort`) run on meta tensors. While loading, `torch.equal` (a load-time check of two
    scale tensors) answers True: only the pass must not read the device."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake, self.loading = fake, True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.loading and func is torch.equal:
            return True
        if not self.loading:
            _refuse_host_tensors(resolve_name(func) or str(func), args, kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if NO_CUDA not in str(e):
                raise
        return _on_meta(self.fake, func, args, kwargs)


def _on_meta(fake: FakeTensorMode, func, args, kwargs):
    """`func` on meta tensors with the fake CUDA arguments' layout; new results become fake CUDA tensors,
    results that are an argument (in-place ops) that argument."""
    originals: dict[int, torch.Tensor] = {}

    def to_meta(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            return t
        with unset_fake_temporarily():
            m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        originals[id(m)] = t
        return m

    margs, mkwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)
    with unset_fake_temporarily():
        out = func(*margs, **mkwargs)

    def back(m):
        if not isinstance(m, torch.Tensor) or m.device.type != "meta":
            return m
        if id(m) in originals:  # an in-place op's result is its argument
            return originals[id(m)]
        return fake.fake_tensor_converter.from_meta_and_device(fake, m, torch.device("cuda"))

    return tree_map(back, out)


class _Address:
    """A fake tensor as Triton's launcher sees a tensor argument: its dtype and its address, here a block of
    the caching allocator (they start 512 bytes apart) plus the tensor's offset into its storage."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self.address = t.dtype, 512 * 1024 + t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:
        return self.address


@functools.cache
def _binder(kernel, arch: str):
    """Triton's own argument binder for `kernel` (a `triton.jit` function, or the interpreter's, whose jit
    arguments it keeps) on NVIDIA's backend for `arch`: what its launcher calls to make a launch's key."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):
        jit = {k: v for k, v in kernel.kwargs.items() if k.startswith("do_not_specialize")}
        kernel = JITFunction(kernel.fn, **jit)
    major, minor = CAPABILITY[arch]
    backend = CUDABackend(GPUTarget("cuda", major * 10 + minor, 32))
    return create_function_from_signature(kernel.signature, kernel.params, backend)


def specialization(kernel, arch: str, args: tuple, meta: dict) -> tuple:
    """The key a launch of `kernel` compiles under on a GPU of `arch`, made by Triton's own binder
    (`create_function_from_signature` in `triton/runtime/jit.py`): constexprs by value, each int as 1, a
    multiple of 16 or neither (unless the kernel says `do_not_specialize`), each tensor by its dtype and
    whether its address is a multiple of 16, and the launch options (`num_warps`, `num_stages`). A launch
    whose key Triton has not met compiles the kernel again, on the host, in the middle of the pass that
    launched it (the disk cache serves later processes)."""
    args = tuple(_Address(a) if isinstance(a, torch.Tensor) else a for a in args)
    meta = {k: _Address(v) if isinstance(v, torch.Tensor) else v for k, v in meta.items()}
    _, key, options = _binder(kernel, arch)(*args, **meta)
    return (*key, *sorted(options.items()))


class Launcher:
    """Stands for a jitted Triton kernel: `kernel[grid](*args)` checks its tensors are on the GPU and counts
    the launch and the bytes of its tensor arguments, each touched once, and the key it compiles under
    (`specialization`, where the real kernel `source` is given)."""

    def __init__(self, name: str, counter: OpCounter, source=None, arch: str = "sm90") -> None:
        self.name, self.counter, self.source, self.arch = name, counter, source, arch

    def __getitem__(self, grid):
        def launch(*args, **meta):
            tensors = _tensors(args)
            for a in tensors:
                if a.device.type != "cuda":
                    raise RuntimeError(f"Triton {self.name} launched with a {a.device.type} tensor")
            if self.counter.counting:
                self.counter.ops[f"triton::{self.name}"] += 1
                self.counter.bytes[f"triton::{self.name}"] += sum(footprint(t) for t in tensors)
                if self.source is not None:
                    self.counter.compiles[self.name].add(specialization(self.source, self.arch, args, meta))

        return launch


class Launchers:
    """Stands for a module of jitted kernels (`kernels.jit.quant`): each attribute is a `Launcher` of the
    module's kernel of that name."""

    def __init__(self, counter: OpCounter, source=None, arch: str = "sm90") -> None:
        self.counter, self.source, self.arch = counter, source, arch

    def __getattr__(self, name: str) -> Launcher:
        kernel = None if self.source is None else getattr(self.source, name)
        return Launcher(name, self.counter, kernel, self.arch)


_LIBS: list[torch.library.Library] = []  # registrations live as long as their Library object


class GroupedFallbackReadsHost(DataDependentOutputException):
    """torch's grouped GEMM on a GPU or dtype its kernels do not take: `_grouped_mm_fallback` copies the group
    offsets to the host (`GroupedMMUtils.h`), a host read in the pass."""


def cuda_grouped_checks(grouped_mm, arch: str, kind: str = ""):
    """torch's grouped GEMMs as a GPU of `arch` runs them, where fake tensors cannot tell: the scaled ones
    (`kind` "scaled") refuse every GPU but compute capability 9.x and 10.x (`_scaled_mm_allowed_device(
    sm90_only, sm100_only)` in cuda/GroupedBlas.cpp), and `F.grouped_mm` there, or in a dtype other than bf16,
    takes its fallback, which reads the offsets on the host."""
    from pipeline.model.network import GROUPED_MM_KERNEL_MAJORS

    served = CAPABILITY[arch][0] in GROUPED_MM_KERNEL_MAJORS

    @functools.wraps(grouped_mm)
    def checked(a, b, *rest, **kw):
        if kind == "scaled" and not served:
            raise RuntimeError("torch._scaled_grouped_mm is only supported on CUDA devices with compute "
                               "capability = [9.0, 10.0]")  # fmt: skip
        if not kind and (not served or a.dtype != torch.bfloat16):
            raise GroupedFallbackReadsHost(torch.ops.aten._grouped_mm.default)
        return grouped_mm(a, b, *rest, **kw)

    return checked


# the block-scaled recipes (NVFP4, MX formats) whose scales CUDA's `_scaled_mm_v2` reads in a swizzled layout
BLOCK_SCALED = (
    torch.nn.functional.ScalingType.BlockWise1x16.value,
    torch.nn.functional.ScalingType.BlockWise1x32.value,
)


def cuda_scaled_mm_checks(scaled_mm_v2):
    """`torch._scaled_mm_v2` (or `_scaled_grouped_mm_v2`, whose first eight arguments are the same) with the
    argument check CUDA's kernel makes and the meta function (which fake tensors run) does not: a
    block-scaled operand takes one swizzle per scale (`check_swizzle_lengths` in ATen's cuda/ScaledBlas.cpp,
    `normalize_grouped_swizzles` in newer cuda/GroupedBlas.cpp: NVFP4's block scales and global scale, two),
    else the same ValueError."""

    @functools.wraps(scaled_mm_v2)
    def checked(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, *rest, **kw):
        for name, scales, recipe, swizzle in (
            ("a", scale_a, recipe_a, swizzle_a),
            ("b", scale_b, recipe_b, swizzle_b),
        ):
            if any(r in BLOCK_SCALED for r in recipe) and len(swizzle) != len(scales):
                raise ValueError(f"swizzle_{name} must have {len(scales)} values, got {len(swizzle)}")
        return scaled_mm_v2(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, *rest, **kw)

    return checked


ROWWISE = torch.nn.functional.ScalingType.RowWise.value


def _rowwise_grouped_checks(a, b, scale_a, scale_b, out_dtype) -> None:
    """What CUDA's FP8 row-wise grouped GEMM asks of its 2-D x 3-D arguments and a meta function need not:
    a row-major, each group of b column-major (b [E, K, N] the transpose of a contiguous [E, N, K]), K a
    multiple of 16 (16-byte rows of FP8), one fp32 scale per row of a ([M]) and per column of each group of
    b ([E, N]), both contiguous, and a bf16 result."""
    (m, k), (e, _, n) = a.shape, b.shape

    def fp32(scale: torch.Tensor, shape: tuple[int, ...]) -> bool:
        return scale.shape == shape and scale.dtype == torch.float32 and scale.is_contiguous()

    needs = {
        "a row-major": a.stride(1) == 1,
        "b's groups column-major": b.stride(1) == 1,
        f"K ({k}) a multiple of 16": k % 16 == 0,
        f"scale_a fp32 [{m}] contiguous": fp32(scale_a, (m,)),
        f"scale_b fp32 [{e}, {n}] contiguous": fp32(scale_b, (e, n)),
        "a bf16 result": (out_dtype or torch.bfloat16) == torch.bfloat16,
    }
    if missing := [what for what, ok in needs.items() if not ok]:
        raise RuntimeError(f"FP8 row-wise grouped GEMM needs {', '.join(missing)}")


def _grouped_meta() -> None:
    """A meta function for `aten::_scaled_grouped_mm_v2` in its 2-D x 3-D form (torch 2.13 has none):
    a [M, K] (FP4: [M, K/2] packed) times b [E, K, N] in groups ending at `offs` [E] is [M, N]."""
    name = "aten::_scaled_grouped_mm_v2"
    if _LIBS or not hasattr(torch.ops.aten, "_scaled_grouped_mm_v2"):
        return
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return

    def meta(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, offs=None, bias=None,
             out_dtype=None, contraction_dim=(), use_fast_accum=False):  # fmt: skip
        if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
            raise RuntimeError(
                f"grouped GEMM of {tuple(a.shape)} and {tuple(b.shape)}: not [M, K] x [E, K, N]"
            )
        if offs is None or offs.shape != (b.shape[0],) or offs.dtype != torch.int32:
            raise RuntimeError("grouped GEMM offsets must be int32 [E]")
        if list(recipe_a) == [ROWWISE] and list(recipe_b) == [ROWWISE]:
            _rowwise_grouped_checks(a, b, scale_a[0], scale_b[0], out_dtype)
        return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or torch.bfloat16)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_grouped_mm_v2", meta, "Meta")
    _LIBS.append(lib)


@contextlib.contextmanager
def fake_gpu(arch: str) -> Iterator[tuple[FakeTensorMode, OpCounter, _Functions]]:
    """Fake CUDA tensors of a GPU of `arch`, with Triton launches counted instead of run."""
    _grouped_meta()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    ops = OpCounter(fake)
    calls = _Functions(fake)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch("torch.cuda.get_device_capability", lambda device=None: CAPABILITY[arch])
        )
        # a Linux CUDA build of torch, which has flash attention (a CPU build says it has none)
        stack.enter_context(mock.patch("torch.backends.cuda.is_flash_attention_available", lambda: True))
        stack.enter_context(
            mock.patch.object(torch, "_scaled_mm_v2", cuda_scaled_mm_checks(torch._scaled_mm_v2))
        )
        grouped = cuda_grouped_checks(cuda_scaled_mm_checks(torch._scaled_grouped_mm_v2), arch, "scaled")
        stack.enter_context(mock.patch.object(torch, "_scaled_grouped_mm_v2", grouped))
        stack.enter_context(
            mock.patch.object(torch, "_grouped_mm", cuda_grouped_checks(torch._grouped_mm, arch))
        )
        moe = Launcher("moe_gemm", ops, kernels.moe._kernel(), arch)
        stack.enter_context(mock.patch.object(kernels.moe, "_kernel", lambda: moe))
        # one launch per GEMM whatever its tile: no measured tile table is looked for
        stack.enter_context(
            mock.patch.object(kernels.moe_tiles, "table_and_path", lambda device, operand: None)
        )
        for family in (kernels.quant, kernels.chains, kernels.routing):
            launchers = Launchers(ops, family._kernels(), arch)
            stack.enter_context(mock.patch.object(family, "_kernels", lambda launchers=launchers: launchers))
        # the RowWise GEMMs' unit row scales are cached per device, outside graph capture: here fake tensors
        # of this mode only, and no capture (a CPU build of torch cannot say)
        stack.enter_context(mock.patch.dict(tensor_cores._UNIT_ROWS, clear=True))
        stack.enter_context(mock.patch.object(tensor_cores, "_OUTGROWN_ROWS", []))
        stack.enter_context(mock.patch("torch.cuda.is_current_stream_capturing", lambda: False))
        for mode in (fake, ops, calls):
            stack.enter_context(mode)
        yield fake, ops, calls


def to_fake_cuda(model: DiffusionGemma, fake: FakeTensorMode) -> None:
    dev = torch.device("cuda")
    convert = lambda t: fake.fake_tensor_converter.from_meta_and_device(fake, t, dev)
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = torch.nn.Parameter(convert(p.data), requires_grad=False)
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = convert(b)
