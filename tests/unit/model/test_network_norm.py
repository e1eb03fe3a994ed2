"""RMSNorm's fp32 fast path (torch's fused `rms_norm`) gives the bits of the written-out formula, so the
swap changes no token."""

import pytest
import torch

from pipeline.model.network import RMSNorm


def written_out(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    out = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + norm.eps, -0.5)
    return out * norm.weight if norm.weight is not None else out


@pytest.mark.parametrize("shape", [(1, 82, 96), (164, 96), (1, 82, 4, 24), (2, 256, 512), (3, 7, 2816)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_fp32_fast_path_is_bit_identical(shape: tuple[int, ...], with_scale: bool) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6, with_scale=with_scale)
    if with_scale:
        norm.weight.data = torch.randn(shape[-1], generator=g)
    with torch.inference_mode():
        for scale in (1e-3, 1.0, 300.0):
            x = torch.randn(*shape, generator=g) * scale
            fast = norm(x)
            assert torch.equal(fast, written_out(norm, x))
            assert not torch.equal(fast, written_out(norm, x * 1.5))  # the comparison can fail
