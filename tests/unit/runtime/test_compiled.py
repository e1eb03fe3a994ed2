"""torch.compile'd network passes (`pipeline.runtime.compiled`) against the eager ones they replace."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.config import SamplerConfig
from pipeline.runtime.compiled import compile_model, is_compiled
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from tests._utils.tiny import build_tiny

pytestmark = pytest.mark.slow  # inductor compiles C++ kernels for the layer graphs: ~15 s on two CPU cores


def generate(model, reqs):
    return BlockDiffusionRuntime(model, max_batch=len(reqs), max_len=128).generate(reqs)


def test_compiled_passes_give_the_eager_tokens():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager, compiled = build_tiny(seed=3), build_tiny(seed=3)
    eager.cfg.eos_token_id = compiled.cfg.eos_token_id = [999]  # no early end: the whole canvas
    compile_model(compiled)
    assert is_compiled(compiled) and compile_model(compiled) is compiled  # idempotent
    counters.clear()
    sampler = SamplerConfig(max_denoising_steps=4, confidence_threshold=0.0)
    reqs = [
        Request(prompt_ids=list(range(2 + i, 2 + i + n)), max_tokens=8, sampler=sampler, seed=s, request_id=i)
        for i, (n, s) in enumerate(((5, 1), (5, 2)))
    ]
    with torch.inference_mode():
        want, got = generate(eager, reqs), generate(compiled, reqs)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert len(want[0].tokens) == 8
    # the layers ran compiled: a few graphs shared by all layers (per layer kind and pass), none broken
    # (the routed experts enter as the custom op)
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 16, graphs
    assert not counters["graph_break"], dict(counters["graph_break"])
