"""Round-to-nearest-even float casts for Triton's CPU interpreter.

The interpreter converts fp32 to E4M3 and to bf16 with its own bit arithmetic (Triton 3.9,
`triton/runtime/interpreter.py: _convert_float`): it rounds half up on the first dropped bit, ignoring the
rest, and truncates into E4M3's subnormals, where a GPU's `cvt.rn` rounds to nearest even; and it widens a
subnormal bf16 value to a wrong fp32 one (it renormalises it below fp32's exponent range). Tests that hold a
kernel to torch's arithmetic bit for bit install torch's own conversions (IEEE round to nearest even) for
those three casts, so what they compare is the kernel's arithmetic, not the interpreter's casts.

The interpreter has no libdevice functions either (`libdevice.tanh` returns None there): `interpreted_tanh`
and `interpreted_exp` put numpy's fp32 tanh and exp in their places, within an ulp or two of CUDA's and of
torch's CPU functions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

TORCH_DTYPES = {"fp8e4nv": (torch.float8_e4m3fn, torch.uint8), "bf16": (torch.bfloat16, torch.int16)}


@pytest.fixture
def rne_casts(monkeypatch):
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype.name == "bf16" and output_dtype.name == "fp32":  # exact, subnormals included
            bf16 = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy()).view(torch.bfloat16)
            return bf16.float().numpy().view(np.uint32).reshape(data.shape)
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
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    def tanh(x, _semantic=None):
        return tl.tensor(interpreter.TensorHandle(np.tanh(x.handle.data), x.handle.dtype.scalar), x.type)

    monkeypatch.setattr(libdevice, "tanh", tanh)


@pytest.fixture
def interpreted_exp(monkeypatch):
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    def exp(x, _semantic=None):
        return tl.tensor(interpreter.TensorHandle(np.exp(x.handle.data), x.handle.dtype.scalar), x.type)

    monkeypatch.setattr(libdevice, "exp", exp)
