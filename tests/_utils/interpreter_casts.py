"""Round-to-nearest-even float casts for Triton's CPU interpreter.

The interpreter converts fp32 to E4M3 and to bf16 with its own bit arithmetic (Triton 3.9,
`triton/runtime/interpreter.py: _convert_float`): it rounds half up on the first dropped bit, ignoring the
rest, and truncates into E4M3's subnormals, where a GPU's `cvt.rn` rounds to nearest even; it widens a
subnormal bf16 value to a wrong fp32 one (it renormalises it below fp32's exponent range); and it widens
E4M3FN's NaN (0x7F) to 480, a finite value, where a GPU's conversion gives NaN (so an NVFP4 block scale that
is NaN would pass `s >= 1e-5` there). Tests that hold a kernel to torch's arithmetic bit for bit install
torch's own conversions (IEEE round to nearest even, exact widening) for those four casts, so what they
compare is the kernel's arithmetic, not the interpreter's casts.

The interpreter has no libdevice functions either (`libdevice.tanh` returns None there): `interpreted_tanh`
and `interpreted_exp` put numpy's fp32 tanh and exp in their places, within an ulp or two of CUDA's and of
torch's CPU functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

# Triton's interpreter is on where no GPU is (tests/conftest.py): the kernel tests that run kernels need it
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's interpreter is on where no GPU is (tests/conftest.py)",
)

TORCH_DTYPES = {"fp8e4nv": (torch.float8_e4m3fn, torch.uint8), "bf16": (torch.bfloat16, torch.int16)}


@pytest.fixture
def rne_casts(monkeypatch):
    install_rne_casts(monkeypatch)


def install_rne_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's fp32 <-> bf16 / E4M3 conversions replaced by torch's (`rne_casts`)."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype.name in TORCH_DTYPES and output_dtype.name == "fp32":  # exact: subnormals, NaN
            dtype, bits = TORCH_DTYPES[input_dtype.name]
            raw = np.ascontiguousarray(data).view(np.uint8 if bits == torch.uint8 else np.int16).copy()
            return torch.from_numpy(raw).view(dtype).float().numpy().view(np.uint32).reshape(data.shape)
        target = TORCH_DTYPES.get(output_dtype.name)
        if input_dtype.name != "fp32" or target is None:
            return convert(data, input_dtype, output_dtype, rounding_mode)
        dtype, bits = target
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
        out = values.to(dtype).view(bits).numpy()
        return out.view(np.uint8 if bits == torch.uint8 else np.uint16).reshape(data.shape)

    monkeypatch.setattr(interpreter, "_convert_float", rounded)


@pytest.fixture
def interpreted_tanh(monkeypatch):
    install_numpy_libdevice(monkeypatch, "tanh")


@pytest.fixture
def interpreted_exp(monkeypatch):
    install_numpy_libdevice(monkeypatch, "exp")


def install_numpy_libdevice(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """libdevice's `name` (tanh, exp) as numpy's fp32 function, in the interpreter."""
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    numpy_fn = getattr(np, name)

    def fn(x, _semantic=None):
        return tl.tensor(interpreter.TensorHandle(numpy_fn(x.handle.data), x.handle.dtype.scalar), x.type)

    monkeypatch.setattr(libdevice, name, fn)


@contextlib.contextmanager
def uninitialised_bytes_are_0xab() -> Iterator[None]:
    """torch.empty's uint8 tensors filled with 0xAB, as memory a GPU allocator hands back may hold: a kernel
    meant to write every byte of its output (padding included) is seen to."""
    empty = torch.empty

    def filled(*size, dtype=None, **kw):
        t = empty(*size, dtype=dtype, **kw)
        return t.fill_(0xAB) if dtype == torch.uint8 else t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", filled)
        yield
