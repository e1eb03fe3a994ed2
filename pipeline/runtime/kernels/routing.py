"""A layer's routing on CUDA in two Triton kernels: the router's top-k (`top_k`, what
`pipeline.model.network.route_scores` computes from the router's scores) and the routed slots' order by
expert (`expert_order`, what `pipeline.model.scaled_layout.expert_order` computes). Eagerly torch takes
about ten kernels a layer for the two, each a launch of a few microseconds even inside a CUDA graph and
each on a few kilobytes: at one canvas about 300 of the FP8 26B pass's 1,164 launches (`dgpipe bench
gpu-trace`), more at 16 canvases, where torch's sort becomes a radix sort of several passes.

Top-k: the softmax, the top k, their sum, the renormalisation, the gather of the experts' scales and the
product, six kernels, become one; a program routes a block of tokens, each token's scores in registers. It
computes what torch's CUDA kernels compute: the softmax in fp32 as exp(s - max) / sum with CUDA's `expf`
(libdevice's, what torch's `std::exp` compiles to) and an IEEE division, the k largest probabilities
descending, the lower expert first among equal ones (torch's CUDA top-k takes the lower index at the k-th
value), the renormalisation by an IEEE division and the scale product in fp32. Only the two sums add in
another order, so a weight can land an fp32 rounding or two away, and a choice between two probabilities
that close can differ (`probe.routing.same_top_k`).

Expert order: torch sorts the slots' experts stably (for more than 4,096 slots a radix sort over all 64
bits of the keys: about ten kernels), then an arange, a division for each slot's token and a search for the
experts' end offsets. Here a program per expert counts the slots of lower experts, then writes its own
slots in increasing order where that stable sort puts them: integers, so bit for bit torch's result. Each
program reads every slot's expert twice (from L2: 256 KiB at 16 canvases), so past `ORDER_MAX_SLOTS`
torch's sort keeps the job.

The load-time probe holds each to its torch form on the GPU before a model uses it
(`pipeline.runtime.probe.check_triton_top_k`, `check_triton_expert_order`). Under torch.compile the torch
forms stay (inductor fuses them).
"""

from __future__ import annotations

import functools

import torch

from pipeline.model import scaled_layout as sl
from pipeline.model.network import route_scores

TOP_K_VALUES = 2048  # scores per program: 16 tokens of the 26B's 128 experts
TOP_K_MAX_EXPERTS = 1024
TOP_K_MAX_K = 32  # the selection loop is unrolled k times
SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ORDER_COUNT = 4096  # slots per step of the first sweep (a count)
ORDER_CHUNK = 2048  # slots per step of the second (a running rank)
ORDER_MAX_SLOTS = 65536  # 8,192 tokens of top-8 routing; the 26B's pass at 16 canvases routes 32,768
OPTIONS = {"num_warps": 4}
# a program per expert, one to an SM: eight warps keep more of its loads in flight (and at four, a step of
# 4,096 int64 experts spills registers on sm_90a and sm_100a)
ORDER_OPTIONS = {"num_warps": 8}


@functools.cache
def _kernels():
    """The jitted kernels, imported on first use (Triton reads TRITON_INTERPRET when `jit` wraps them)."""
    from pipeline.runtime.kernels.jit import routing as jit_routing

    return jit_routing


def top_k_serves(scores: torch.Tensor, k: int, scale: torch.Tensor) -> bool:
    """Whether the kernel takes router scores [tokens, experts] (bf16/fp16/fp32, contiguous, at most
    `TOP_K_MAX_EXPERTS` experts), 1 <= k <= min(experts, `TOP_K_MAX_K`), and one float scale per expert."""
    experts = scores.shape[-1]
    return (
        scores.dtype in SCORE_DTYPES
        and scores.dim() == 2
        and scores.is_contiguous()
        and 1 <= experts <= TOP_K_MAX_EXPERTS
        and 1 <= k <= min(experts, TOP_K_MAX_K)
        and scale.dtype in SCORE_DTYPES
        and scale.shape == (experts,)
        and scale.is_contiguous()
    )


def top_k(scores: torch.Tensor, k: int, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [tokens, k], experts int64 [tokens, k]) from router scores (`top_k_serves` must hold):
    each token's k most probable experts, their probabilities renormalised and times the experts' scales."""
    import triton

    tokens, experts = scores.shape
    weights = torch.empty(tokens, k, dtype=torch.float32, device=scores.device)
    index = torch.empty(tokens, k, dtype=torch.int64, device=scores.device)
    if tokens:
        e_p2 = triton.next_power_of_2(experts)
        block = max(1, TOP_K_VALUES // e_p2)
        _kernels().top_k[(triton.cdiv(tokens, block),)](
            scores, scale, weights, index, tokens, E=experts, K=k, E_P2=e_p2, K_P2=triton.next_power_of_2(k),
            BLOCK_T=block, **OPTIONS,
        )  # fmt: skip
    return weights, index


def top_k_or_torch(scores: torch.Tensor, k: int, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k` where it serves (`top_k_serves`), else the torch form: what the GPU loader installs."""
    if top_k_serves(scores, k, scale):
        return top_k(scores, k, scale)
    _, weights, index = route_scores(scores, k, scale)
    return weights, index


def expert_order_serves(index: torch.Tensor, num_experts: int) -> bool:
    """Whether the kernel takes routed experts [tokens, k] (int64, contiguous, k >= 1, at most
    `ORDER_MAX_SLOTS` slots)."""
    return (
        index.dtype == torch.int64
        and index.dim() == 2
        and index.shape[1] >= 1
        and index.is_contiguous()
        and index.numel() <= ORDER_MAX_SLOTS
        and 1 <= num_experts < 2**31
    )


def expert_order(index: torch.Tensor, num_experts: int) -> sl.ExpertOrder:
    """`scaled_layout.expert_order` in one launch (`expert_order_serves` must hold, every expert in
    [0, num_experts)), with `rows`, the order's inverse, which torch's form computes in two more where the
    combine reads it (`scaled_layout.slot_rows`)."""
    slots = index.numel()
    order = torch.empty(slots, dtype=torch.int64, device=index.device)
    token_of, rows = torch.empty_like(order), torch.empty_like(order)
    offs = torch.empty(num_experts, dtype=torch.int32, device=index.device)
    _kernels().expert_order[(num_experts,)](
        index,
        order,
        token_of,
        offs,
        rows,
        index.shape[0],
        K=index.shape[1],
        COUNT=ORDER_COUNT,
        CHUNK=ORDER_CHUNK,
        **ORDER_OPTIONS,
    )
    return sl.ExpertOrder(order, token_of, offs, rows)


def expert_order_or_torch(index: torch.Tensor, num_experts: int) -> sl.ExpertOrder:
    """`expert_order` where it serves (`expert_order_serves`), else the torch form: what the GPU loader installs."""
    if expert_order_serves(index, num_experts):
        return expert_order(index, num_experts)
    return sl.expert_order(index, num_experts)
