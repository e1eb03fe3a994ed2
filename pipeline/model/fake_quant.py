"""Plain-PyTorch fake quantization of linear inputs, matching what the quantized kernels compute.

Used by dgpipe's runtime on an exported ModelOpt checkpoint, so an FP8 or NVFP4 model is evaluated on CPU
with the activation rounding it will see on the GPU (ModelOpt's own NVFP4 forward needs CUDA):

* FP8 (static per-tensor): q = e4m3(clamp(x / input_scale)) * input_scale.
* NVFP4 (dynamic per-16 block, static global scale): input_scale = amax / (6 * 448) is the global scale;
  each block of 16 gets an E4M3 scale s = e4m3(min(block_amax / (6 * input_scale), 448)) * input_scale
  (1.0 where s < 1e-5), and x / s is rounded to the nearest E2M1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6},
  ties to the even mantissa, as in ModelOpt's `fp4_fake_quant_block` kernel and TensorRT's NVFP4 dynamic
  quantize.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # NVFP4: one E4M3 scale per 16 consecutive values along the input dim
ACTIVATION_FORMATS = ("fp8", "nvfp4")  # what InputQuantizer emulates; other precisions keep 16-bit inputs
# E2M1 magnitudes and the decision points between them; at a midpoint the even-mantissa value wins
# (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)  # the midpoints that round up
_STEPS = tuple((E2M1_VALUES[1:] - E2M1_VALUES[:-1]).tolist())  # magnitude gained past each decision point


def e2m1_round(a: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude of a >= 0 (saturating at 6), ties to even: the sum of the steps between
    neighbouring magnitudes whose decision point `a` passes (exact in float). Python-float constants only:
    no host tensor is copied to `a`'s device, which a CUDA graph capture forbids, and torch.compile traces it."""
    out = torch.zeros_like(a)
    for b, step in zip(_BOUNDS, _STEPS, strict=True):
        out += step * ((a >= b) if b in _TIES_UP else (a > b))
    return out


def fp8_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What QuantizeLinear -> DequantizeLinear computes for FP8 E4M3FN (saturating, round to nearest even)."""
    xf = x.float()
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.to(x.dtype)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    gs = torch.where(global_scale > 0, global_scale, torch.full_like(global_scale, 1e-12)).float()
    block_amax = xf.abs().amax(-1, keepdim=True)
    s = (block_amax / (E2M1_MAX * gs)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float() * gs
    s = torch.where(s >= 1e-5, s, torch.ones_like(s))
    q = e2m1_round(xf.abs() / s) * s
    return torch.where(xf >= 0, q, -q).reshape(shape).to(x.dtype)


class InputQuantizer:
    """Callable applied to a linear's input: optional AWQ pre_quant_scale, then the format's rounding."""

    def __init__(
        self, kind: str | None, scale: torch.Tensor | None, pre_quant_scale: torch.Tensor | None = None
    ):
        if kind is not None and kind not in ACTIVATION_FORMATS:
            raise ValueError(f"unknown activation format {kind!r}")
        self.kind = kind
        self.scale = scale.float() if scale is not None else None
        self.pre_quant_scale = pre_quant_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.kind == "fp8":
            return fp8_fake_quant(x, self.scale)
        if self.kind == "nvfp4":
            return nvfp4_fake_quant(x, self.scale)
        return x

    def __repr__(self) -> str:
        return f"InputQuantizer({self.kind}, scale={None if self.scale is None else float(self.scale.max()):.3g})"
