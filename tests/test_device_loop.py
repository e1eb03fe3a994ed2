"""The device-resident denoise loop: host checks every k passes, grouped-GEMM MoE, CUDA-graph replay.

On any machine: checking for finished canvases only every k passes must not change a single token or
step count (finished rows are frozen on the device), and the capturable grouped-GEMM MoE must equal the
per-expert loop. On a GPU: a runtime that replays CUDA graphs must give exactly the eager runtime's output.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from pipeline.config import SamplerConfig
from pipeline.runtime import BlockDiffusionRuntime, Request

FIXED = SamplerConfig(max_denoising_steps=5, confidence_threshold=0.0)


def requests(sampler: SamplerConfig, prompts=([2, 5, 6], [2, 7], list(range(2, 14)), [3])) -> list[Request]:
    return [
        Request(prompt_ids=p, max_tokens=20 + 4 * i, sampler=sampler, seed=11, request_id=i)
        for i, p in enumerate(prompts)
    ]


def generate(model, reqs, **kw):
    rt = BlockDiffusionRuntime(model, max_batch=kw.pop("max_batch", 3), max_len=kw.pop("max_len", 128), **kw)
    return rt, rt.generate(reqs)


def same_results(a_list, b_list) -> None:
    for a, b in zip(a_list, b_list, strict=True):
        assert (a.tokens, a.steps_per_canvas, a.finish_reason) == (
            b.tokens,
            b.steps_per_canvas,
            b.finish_reason,
        )


def test_checking_every_k_passes_changes_nothing_fixed_steps():
    """4 requests on 3 slots (one joins later), mixed prompt lengths, several canvases each."""
    model = build_tiny(torch.float64)
    rt1, every = generate(model, requests(FIXED), sync_every=1)
    rt4, every4 = generate(model, requests(FIXED), sync_every=4)
    same_results(every, every4)
    assert rt4.passes["denoise"] > rt1.passes["denoise"]  # frozen rows rode along until the next check


def test_checking_every_k_passes_changes_nothing_adaptive():
    """The embedded model stops canvases at different steps; the result must not depend on k."""
    from pipeline import sudoku
    from pipeline import sudoku_tokenizer as stok
    from pipeline.session import load_session

    session = load_session()
    prompts = [stok.sudoku_prompt_ids(p) for p, _ in sudoku.make_dataset(5, 6, (45, 61))]
    kw = {"max_batch": 4, "max_len": 512}
    _, every = generate(session.model, requests(session.sampler(), prompts), sync_every=1, **kw)
    _, every3 = generate(session.model, requests(session.sampler(), prompts), sync_every=3, **kw)
    same_results(every, every3)
    steps = {s for r in every for s in r.steps_per_canvas}
    assert len(steps) > 1, steps  # canvases really stopped at different steps


def test_grouped_gemm_moe_equals_the_expert_loop():
    model = build_tiny(torch.float32, text_config={"hidden_size": 64, "moe_intermediate_size": 32})
    experts = model.layers[0].experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=gen)
    scores = torch.randn(37, experts.num_experts, generator=gen).softmax(-1)
    weights, index = torch.topk(scores, k=2, dim=-1)
    index[:5] = torch.tensor([0, 1])  # an expert that some tokens share, and (below) one left empty
    index[index == 3] = 2
    experts.grouped = False
    loop = experts(x, index, weights)
    experts.grouped = True
    grouped = experts(x, index, weights)
    assert loop.abs().max() > 0.1
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)
def test_cuda_graph_replay_equals_eager_on_gpu():
    """bf16 on CUDA with the fused sampler: graphs captured once per round, tokens identical to eager."""
    from pipeline.backends import TorchBackend
    from pipeline.kernels.build import load_torch_extension

    load_torch_extension()
    model = build_tiny(torch.float32, text_config={"hidden_size": 64, "moe_intermediate_size": 32})
    model = model.to("cuda", torch.bfloat16)
    backend = TorchBackend(model)
    assert backend.fused and backend.graph_safe
    rt_eager, eager = generate(backend, requests(FIXED), graphs=False, sync_every=4)
    rt_graph, graphed = generate(backend, requests(FIXED), graphs=True, sync_every=4)
    assert rt_graph.loop.captures > 0 and rt_eager.loop.captures == 0
    for a, b in zip(eager, graphed):
        assert (a.tokens, a.steps_per_canvas) == (b.tokens, b.steps_per_canvas)
