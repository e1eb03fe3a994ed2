"""`combine_top_k`, the CUDA experts' combine (bf16 grouped and tensor-core paths): the rows gathered back
to slot order and weighted per token equal the scatter-add the CPU path keeps."""

from __future__ import annotations

import torch

from pipeline.model.network import combine_slots, combine_top_k
from pipeline.model.scaled_layout import ExpertOrder, slot_rows


def test_slot_rows_gather_sorted_rows_back():
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    y = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))
    routing = ExpertOrder(order, order // 3, torch.zeros(1, dtype=torch.int32))
    assert torch.equal(y[order].index_select(0, slot_rows(routing)), y)
    written = routing._replace(rows=torch.arange(12))  # an order kernel's rows are taken as they are
    assert slot_rows(written) is written.rows


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
    routing = ExpertOrder(order, order // k, torch.zeros(e, dtype=torch.int32))
    torch.testing.assert_close(combine_top_k(y, routing, weights), want)


def test_combine_takes_a_pass_of_no_tokens():
    """A pass of 0 tokens gives [0, d] (a view cannot infer d from no elements)."""
    routing = ExpertOrder(
        *(torch.zeros(0, dtype=torch.int64) for _ in range(2)), torch.zeros(5, dtype=torch.int32)
    )
    y, weights = torch.zeros(0, 7), torch.zeros(0, 3)
    assert combine_top_k(y, routing, weights).shape == combine_slots(y, weights).shape == (0, 7)
