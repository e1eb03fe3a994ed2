"""`attend`: the packed form (a K/V head's query heads stacked along the queries) computes the grouped
form's attention, and it is taken only where the grouped form has no fused CUDA kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.network import attend, attend_packed, attention_kernels, packs_queries


def _qkv(dtype: torch.dtype, heads: int = 16, kv_heads: int = 2, queries: int = 5, keys: int = 9):
    g = torch.Generator().manual_seed(heads + keys)
    # q as attention makes it: [B, Q, H, D] normed per head, then transposed
    q = torch.randn(3, queries, heads, 8, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(3, kv_heads, keys, 8, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(3, 1, queries, keys, generator=g) > 0.3
    mask[..., -1] = True  # every query sees at least one key
    return q, k, v, mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 2), (8, 2), (4, 1), (6, 6)])
def test_packed_queries_compute_the_grouped_attention(masked, heads, kv_heads):
    q, k, v, mask = _qkv(torch.float64, heads, kv_heads)
    mask = mask if masked else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=heads > kv_heads)
    got = attend_packed(q, k, v, mask)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and against the definition: query head h reads K/V head h // groups
    groups = heads // kv_heads
    scores = (q @ k.repeat_interleave(groups, 1).transpose(-1, -2)).masked_fill(
        mask.logical_not() if mask is not None else torch.zeros((), dtype=torch.bool), float("-inf")
    )
    torch.testing.assert_close(got, scores.softmax(-1) @ v.repeat_interleave(groups, 1))


def test_packed_queries_in_bf16_are_the_grouped_kernels_bit_for_bit():
    """In bf16 on the CPU both forms round the same fp32 sums: the packing moves no arithmetic."""
    q, k, v, mask = _qkv(torch.bfloat16)
    for m in (None, mask):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=1.0, enable_gqa=True)
        assert torch.equal(attend_packed(q, k, v, m), want)


def test_the_packed_output_is_what_o_proj_reads():
    """[B, H, Q, D] whose transpose [B, Q, H, D] is contiguous: `o_proj`'s input with no copy."""
    q, k, v, mask = _qkv(torch.float32)
    out = attend_packed(q, k, v, mask)
    assert out.transpose(1, 2).is_contiguous()
    # the grouped form's layout, through the same reshape attention applies
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
    torch.testing.assert_close(out.transpose(1, 2).reshape(3, 5, -1), want.transpose(1, 2).reshape(3, 5, -1))


def test_queries_are_packed_only_for_grouped_cuda_heads_flash_does_not_take(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(
        torch.backends.cuda, "is_flash_attention_available", lambda: True
    )  # a Linux CUDA build
    assert packs_queries(cuda, 512, 8)  # the 26B's global layers: 16 query heads on 2 K/V heads
    assert not packs_queries(cuda, 256, 2)  # its sliding layers: flash takes grouped heads of 256
    assert packs_queries(cuda, 256, 2, masked=True)  # but no mask (rows of several lengths, causal passes)
    assert not packs_queries(cuda, 512, 1, masked=True)  # nothing grouped
    assert not packs_queries(cpu, 512, 8, masked=True)  # the CPU path keeps the grouped form
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)  # Windows wheels
    assert packs_queries(cuda, 256, 2) and not packs_queries(cuda, 256, 1)


def test_cuda_passes_take_every_attention_kernel_but_cudnns_and_the_cpu_what_torch_picks():
    """cuDNN's attention builds a host plan per new shape: out of a CUDA pass's choice, and back after it;
    a kernel the caller turned off stays off."""
    cuda = torch.backends.cuda
    enabled = lambda: (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                       cuda.cudnn_sdp_enabled())  # fmt: skip
    assert enabled() == (True, True, True, True)
    with attention_kernels(torch.device("cuda", 1)):
        assert enabled() == (True, True, True, False)
    with attention_kernels(torch.device("cpu")):
        assert enabled() == (True, True, True, True)
    assert enabled() == (True, True, True, True)
    cuda.enable_flash_sdp(False)
    try:
        with attention_kernels(torch.device("cuda")):
            assert enabled() == (False, True, True, False)
        assert enabled() == (False, True, True, True)
    finally:
        cuda.enable_flash_sdp(True)
    q, k, v, _ = _qkv(torch.float64)
    assert torch.equal(
        attend(q, k, v, None), F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=True)
    )


@pytest.mark.parametrize("keys", [9, 16])
def test_the_packed_mask_is_one_the_memory_efficient_kernel_takes_without_a_copy(monkeypatch, keys):
    """Its strides but the last are multiples of 8 and its last is 1 (`aligned_tensor` in torch's
    attention.cpp), whatever the key count, so the kernel reads it as it is; 0 where visible, -inf elsewhere."""
    q, k, v, mask = _qkv(torch.bfloat16, keys=keys)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recorded(*args, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    attend_packed(q, k, v, mask)
    (bias,) = seen
    assert bias.shape == (3, 1, 8 * 5, keys) and bias.stride(-1) == 1
    assert all(s % 8 == 0 for s in bias.stride()[:-1])
    want = mask[:, :, None].expand(-1, -1, 8, -1, -1).flatten(2, 3)
    assert torch.equal(bias == 0, want) and torch.equal(bias == float("-inf"), ~want)
