"""`encode_kv` (prefill/commit without the last layer's FFN) against the full `encode` it shortens; with a
cache (commits) the runtime's multi-canvas parity tests against transformers cover it."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.kv_cache import attention_masks
from tests._utils.tiny import build_tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_encode_kv_is_encodes_kv_bit_for_bit(dtype):
    model = build_tiny(dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 24, (2, 9), generator=gen)
    positions = torch.arange(9).repeat(2, 1)
    valid = torch.ones(2, 9, dtype=torch.bool)
    masks = attention_masks(positions, valid, None, True, model.cfg.sliding_window)
    with torch.inference_mode():
        _, want = model.encode(prompt, positions, masks)
        got = model.encode_kv(prompt, positions, masks)
    assert len(got) == len(want) == model.cfg.num_hidden_layers
    for (k, v), (k2, v2) in zip(got, want, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
