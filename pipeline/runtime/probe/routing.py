"""The probes of the routing kernels (`kernels.routing`): the router's top-k and the experts' order, on
scores and routings whose right answer no rounding can change."""

from __future__ import annotations

import torch

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.network import (
    route_scores,
)
from pipeline.runtime import kernels
from pipeline.runtime.probe.common import (
    TRITON_FALLBACK,
)


def separated_scores(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router scores [tokens, experts] whose probabilities no rounding can reorder: each row a random
    permutation of steps 1/16 apart around 0 (exact in bf16 up to 256 experts, in fp16 up to 512), so any two
    probabilities differ by a factor of e^(1/16)."""
    return (
        torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).float() - experts // 2
    ) / 16


def same_top_k(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two top-k routings agree as closely as softmax and renormalisation sums added in another
    order let them: the same experts in the same places, each weight within 2^-18 of it (a few fp32
    roundings; a missing renormalisation or scale, or another expert's weight, is off by far more)."""
    (gw, gi), (ww, wi) = got, want
    return torch.equal(gi, wi) and bool(((gw - ww).abs() <= 2.0**-18 * ww.abs()).all())


def check_triton_top_k(dev: torch.device) -> None:
    """dgpipe's top-k kernel against torch's form (`network.route_scores`) on the 26B's routing (128
    experts, top 8, bf16 scores), on fp16 and fp32 scores, and on 100 experts (no power of two) and 4 (top
    2), with random per-expert scales in the scores' dtype: the same experts and weights within a few fp32 roundings
    (`same_top_k`), or a DgpipeError."""
    g = torch.Generator().manual_seed(14)
    for dtype, tokens, experts, k in ((torch.bfloat16, 37, 128, 8), (torch.float16, 37, 128, 8),
                                      (torch.float32, 19, 128, 8), (torch.bfloat16, 5, 100, 8),
                                      (torch.bfloat16, 3, 4, 2)):  # fmt: skip
        scores = separated_scores(tokens, experts, g).to(dev, dtype)
        scale = (torch.rand(experts, generator=g) + 0.5).to(dev, dtype)  # a parameter of the model's dtype
        want = route_scores(scores, k, scale)[1:]
        if not same_top_k(kernels.routing.top_k(scores, k, scale), want):
            raise DgpipeError(
                f"the Triton router top-k differs from torch's ({dtype}, {experts} experts, top {k})",
                TRITON_FALLBACK,
            )


def same_order(got: sl.ExpertOrder, want: sl.ExpertOrder) -> bool:
    """Two orders of the routed slots agree: the same sorted slots, tokens and offsets, and the same sorted
    position of each slot (`scaled_layout.slot_rows`, where either leaves `rows` out)."""
    same = all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    return same and torch.equal(sl.slot_rows(got), sl.slot_rows(want))


# (tokens, top k, experts) of the expert-order probe: the 26B's routing over more slots than one step of
# each of the kernel's sweeps takes, one token's, and (tokens == 9) every slot on one expert
EXPERT_ORDER_CASES = ((600, 8, 128), (1, 8, 128), (9, 2, 4))


def check_triton_expert_order(dev: torch.device) -> None:
    """dgpipe's expert-order kernel against torch's stable sort (`scaled_layout.expert_order`): the 26B's
    routing of 600 tokens (4,800 slots: more than one step of each of the kernel's sweeps, the last partial), one
    token (most experts chosen by none), and every slot on one expert: the same order, tokens, offsets and
    inverse (`same_order`), or a DgpipeError."""
    g = torch.Generator().manual_seed(15)
    for tokens, k, experts in EXPERT_ORDER_CASES:
        index = torch.randint(0, experts, (tokens, k), generator=g)
        if tokens == 9:
            index[:] = 3
        index = index.to(dev)
        if not same_order(kernels.routing.expert_order(index, experts), sl.expert_order(index, experts)):
            raise DgpipeError(
                f"the Triton expert order differs from torch's sort ({tokens} tokens, top {k}, {experts} experts)",
                TRITON_FALLBACK,
            )
