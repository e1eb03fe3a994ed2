"""Compile, while a server loads, the Triton kernels that its passes would otherwise compile mid-request.

Triton compiles a kernel on the host the first time a launch meets a new compile key, wherever its cache
(~/.triton/cache) lacks the binary, as in every fresh container. The pass that launched it waits, and so
does every request in its batch. Token counts are not part of any key (`do_not_specialize`), so the
server's warm-up request compiles nearly everything: a prompt's prefill and one canvas's denoise passes.

What still depends on a pass's size is which GEMMs its tokens take through the experts. The Triton MoE
GEMM's tile is chosen by rows per expert, and above the dispatch row's threshold torch's grouped GEMM takes
over, followed by another form of the combine. The warm-up request meets one or two of these paths. On a
Hopper GPU a first batch of two canvases compiles the 64-row tile, and a first batch of five compiles the
grouped path's combine (`tests/unit/bench/gpu/test_trace.py` traces both).

`warm_experts` runs one pass for each path that a pass of up to `most` tokens can take, at the fewest
tokens that take it. They are K/V passes (`encode_kv`) with no cache and no mask: their output is
dropped, so what they attend to does not matter, and without a mask nothing in them reads the device
from the host. A model under `torch.compile` is left alone: its passes are inductor's graphs, compiled per
shape and mask on first use, and mask-less passes would only compile graphs that no served pass runs.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from pipeline.model.network import DiffusionGemma
from pipeline.runtime.compiled import is_compiled


def _signature(experts: nn.Module) -> tuple:
    """What `gemms_for` depends on: the module's kind, its thresholds and its weights' shapes and dtypes."""
    tensors = itertools.chain(experts.parameters(recurse=False), experts.buffers(recurse=False))
    flags = (getattr(experts, "triton_rows", None), getattr(experts, "triton", None))
    return type(experts), flags, tuple((t.shape, t.dtype) for t in tensors)


def distinct_experts(model: DiffusionGemma) -> list[nn.Module]:
    """One experts module per kind of layer whose GEMMs depend on the pass's size (those with `gemms_for`:
    tensor-core and device-routed experts); the 26B's layers all have the same one. The last layer's are
    left out: a K/V pass does not run them (`encode_kv`), and they are their neighbours' kind."""
    found: dict[tuple, nn.Module] = {}
    for layer in model.layers[:-1]:
        experts = getattr(layer, "experts", None)
        if experts is not None and hasattr(experts, "gemms_for"):
            found.setdefault(_signature(experts), experts)
    return list(found.values())


def warm_token_counts(model: DiffusionGemma, most: int) -> list[int]:
    """The fewest tokens of a pass that take each of the experts' GEMM paths, among passes of 1 to `most`
    tokens, in increasing order. Empty when no layer's GEMMs depend on the pass's size."""
    experts = distinct_experts(model)
    if not experts:
        return []
    k = model.config.text_config.top_k_experts
    first: dict[tuple, int] = {}
    for tokens in range(1, most + 1):
        first.setdefault(tuple(e.gemms_for(tokens * k) for e in experts), tokens)
    return sorted(first.values())


@torch.inference_mode()
def warm_experts(model: DiffusionGemma, device: torch.device, most: int) -> list[int]:
    """Run one K/V pass at each of `warm_token_counts(model, most)` on `device`, which compiles every Triton
    binary the experts' paths need. Returns the token counts. None run on the CPU, where nothing compiles,
    or for a compiled model."""
    if device.type != "cuda" or is_compiled(model):
        return []
    counts = warm_token_counts(model, most)
    unmasked = dict.fromkeys(model.layer_types)
    for tokens in counts:
        positions = torch.arange(tokens, device=device)[None]
        model.encode_kv(torch.zeros_like(positions), positions, unmasked, None)
    return counts
