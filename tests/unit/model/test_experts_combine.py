"""`combine_top_k`, the CUDA experts' combine (bf16 grouped and tensor-core paths): the rows gathered back
to slot order and weighted per token equal the scatter-add the CPU path keeps."""

from __future__ import annotations

import torch

from pipeline.model.network import combine_top_k, inverse_permutation


def test_inverse_permutation_gathers_sorted_rows_back():
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    y = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(y[order].index_select(0, inverse_permutation(order)), y)


def test_combine_equals_the_scatter_add_of_weighted_rows():
    g = torch.Generator().manual_seed(2)
    t, k, e, d = 9, 3, 5, 7
    index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # k distinct experts a token
    weights = torch.rand(t, k, generator=g, dtype=torch.float64)
    order = torch.argsort(index.reshape(-1), stable=True)  # slots sorted by expert, as the grouped GEMM runs
    y = torch.randn(t * k, d, generator=g, dtype=torch.float64)  # each sorted slot's expert output
    want = torch.zeros(t, d, dtype=torch.float64).index_add_(
        0, order // k, y * weights.reshape(-1)[order, None]
    )
    torch.testing.assert_close(combine_top_k(y, order, weights), want)
