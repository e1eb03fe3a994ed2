"""`attend`: the expanded K/V form some CUDA kernels need computes the grouped form's attention, and it is
taken only where the grouped form has no fused CUDA kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.network import attend, expands_kv


@pytest.mark.parametrize("masked", [False, True])
def test_expanded_kv_computes_the_grouped_attention(masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3 if masked else None
    if mask is not None:
        mask[..., -1] = True  # every query sees at least one key
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, scale=1.0
    )
    torch.testing.assert_close(attend(q, k, v, mask), expanded)
    # and against the definition: query head h reads K/V head h // 4
    scores = (q @ k.repeat_interleave(4, 1).transpose(-1, -2)).masked_fill(
        mask.logical_not() if mask is not None else torch.zeros((), dtype=torch.bool), float("-inf")
    )
    torch.testing.assert_close(attend(q, k, v, mask), scores.softmax(-1) @ v.repeat_interleave(4, 1))


def test_kv_is_expanded_only_for_grouped_cuda_heads_past_the_fused_kernels_limit():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert expands_kv(cuda, 512, 8)  # the 26B's global layers: 16 query heads on 2 K/V heads
    assert not expands_kv(cuda, 256, 2)  # its sliding layers: flash / cuDNN take grouped heads of 256
    assert not expands_kv(cuda, 512, 1)  # nothing to expand
    assert not expands_kv(cpu, 512, 8)  # the CPU path keeps the grouped form
