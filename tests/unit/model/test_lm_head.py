"""The CPU LM head computed and softcapped a vocabulary slice at a time equals the one-GEMM statement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._utils.tiny import build_tiny


@pytest.mark.parametrize("vocab", [24, 5000, 40_000])  # one slice; one slice + copy path; several + a tail
def test_sliced_lm_head_equals_linear_then_softcap(vocab):
    model = build_tiny(text_config={"vocab_size": vocab, "hidden_size": 64})
    hidden = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(vocab))
    with torch.inference_mode():
        got = model.logits(hidden)
    cap = model.cfg.final_logit_softcapping
    want = torch.tanh(F.linear(hidden, model.embed_tokens.weight) / cap) * cap
    assert got.shape == (3, 37, vocab) and got.dtype == torch.float32
    assert torch.equal(got, want)
