"""Random quantized weights for the full-size benchmarks: no checkpoint of the 26B is needed to time it."""

from __future__ import annotations

import torch

from pipeline.model.fake_quant import E4M3_MAX
from pipeline.model.modelopt import PackedLinear


def random_packed(
    fmt: str,
    n: int,
    k: int,
    device: torch.device,
    gen: torch.Generator | None = None,
    weight_scale: float = 1.0,
) -> PackedLinear:
    """A random quantized linear in ModelOpt's stored layout, drawn on `device` (the random-weight
    benchmark of a full-size configuration: no checkpoint, no host copy): weights ~ N(0, 0.02). The
    per-tensor scales are host numbers, as a checkpoint's are read; `weight_scale` multiplies the FP8 one
    (ModelOpt's FP8 exports give each linear its own, its NVFP4 ones siblings one global scale)."""
    if fmt == "fp8":
        w = (torch.randn(n, k, device=device, generator=gen) * (E4M3_MAX / 4)).clamp(-E4M3_MAX, E4M3_MAX)
        # clamped first: unclamped, the 26B's routing on an H200 collapsed onto top-k experts (NaN router inputs)
        w = w.to(torch.float8_e4m3fn)
        return PackedLinear("FP8", w, torch.tensor(0.02 * 4 / E4M3_MAX * weight_scale), None,
                            torch.tensor(8.0 / E4M3_MAX))  # fmt: skip
    codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=gen)
    bs = torch.full((n, k // 16), 64.0, device=device).to(torch.float8_e4m3fn)
    return PackedLinear("NVFP4", codes, bs, torch.tensor(0.02 / (64 * 2)), torch.tensor(8.0 / (6 * E4M3_MAX)))
