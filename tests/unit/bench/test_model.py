"""`dgpipe bench model`'s random model: allocated once, in the target dtype."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeline.bench.model import random_model
from pipeline.model.config import ModelConfig
from tests._utils.tiny import TINY


class Allocations(TorchDispatchMode):
    """Bytes of every real (non-meta) tensor an aten op allocates, by dtype (in-place ops allocate none)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.bytes[t.dtype] = self.bytes.get(t.dtype, 0) + t.numel() * t.element_size()
        return out


def test_weights_are_materialised_in_the_target_dtype_only():
    config = ModelConfig.from_dict(TINY)
    with Allocations() as seen:
        model = random_model(config, torch.bfloat16, torch.device("cpu"))
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    param_bytes = sum(p.numel() * 2 for p in params)
    buffers = {n: b for n, b in model.named_buffers()}
    rope = sum(b.numel() * 4 for n, b in buffers.items() if "inv_freq" in n)
    scalars = sum(b.numel() * 2 for n, b in buffers.items() if "inv_freq" not in n)
    assert all(b.dtype == torch.float32 for n, b in buffers.items() if "inv_freq" in n)  # as load_model
    # the bf16 weights once, plus the scalars and the RoPE tables' bf16 placeholders (replaced in fp32);
    # fp32 only for the RoPE tables and their few CPU temporaries
    assert seen.bytes[torch.bfloat16] == param_bytes + scalars + rope // 2
    assert seen.bytes.get(torch.float32, 0) < 8 * rope < param_bytes // 10
