"""Runtime requests and generation shared by the CPU and GPU device-loop tests."""

from __future__ import annotations

from pipeline.model.config import SamplerConfig
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

FIXED = SamplerConfig(max_denoising_steps=5, confidence_threshold=0.0)


def requests(sampler: SamplerConfig, prompts=([2, 5, 6], [2, 7], list(range(2, 14)), [3])) -> list[Request]:
    return [
        Request(prompt_ids=p, max_tokens=20 + 4 * i, sampler=sampler, seed=11, request_id=i)
        for i, p in enumerate(prompts)
    ]


def generate(model, reqs, **kw):
    rt = BlockDiffusionRuntime(model, max_batch=kw.pop("max_batch", 3), max_len=kw.pop("max_len", 128), **kw)
    return rt, rt.generate(reqs)
