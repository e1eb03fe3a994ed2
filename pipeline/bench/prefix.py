"""`dgpipe bench prefix`: time to first canvas with prefix caching on and off, in one interleaved run.

Each request is one long shared system prompt and a short question of its own (the chat shape prefix
caching is for). Two runtimes serve the same model, one with the cache and one without; every request
goes to both, back to back, the order alternating, so load drifts hit both alike. Each runtime first
serves one untimed request (its warm-up, and the cache's first fill). Reported per fixed step count:
the median time to first canvas (submit to the first committed canvas: prefill plus that canvas's
denoise passes), the median prefill time inside it, the hit rate, whether the two runtimes returned
identical tokens for every request (they must: `pipeline.runtime.prefix_cache`), and the most any prefix
cache could give: the cold time over the cached one without its prefill (the first canvas's passes are
the same work either way).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.local import PassTimer
from pipeline.bench.machine import machine
from pipeline.bench.results import save_plot, save_result
from pipeline.limits import PREFILL_CHUNK_TOKENS, context_length
from pipeline.model.config import SamplerConfig

RESULT_FILE, PLOT_FILE = "bench_prefix.json", "bench_prefix.png"
OUTPUT_TOKENS = 16  # one canvas is all a time to first canvas needs


@dataclass
class PrefixRow:
    steps: int
    ttft_on_ms: float
    ttft_off_ms: float
    ttft_ratio: float  # off / on
    # off / (on without its prefill): the ratio a cache that left nothing to prefill would give, since the
    # first canvas's denoise passes are the same work with or without it
    ttft_ratio_bound: float
    prefill_on_ms: float
    prefill_off_ms: float
    hit_rate: float  # prompt tokens served from the cache, timed requests of this row
    identical: bool  # every request's tokens equal with the cache on and off


def _request(prompt: list[int], steps: int, i: int):
    from pipeline.runtime.scheduler import Request

    sampler = SamplerConfig(max_denoising_steps=steps, confidence_threshold=0.0)  # fixed steps
    return Request(prompt, max_tokens=OUTPUT_TOKENS, sampler=sampler, seed=i, request_id=i)


def _serve(runtime, prompt: list[int], steps: int, i: int) -> tuple[float, float, list[int]]:
    """One request alone: (time to first canvas s, prefill s, tokens)."""
    with PassTimer(runtime.backend, "causal") as prefill:
        res = runtime.generate([_request(prompt, steps, i)])[0]
    return res.time_to_first_canvas, prefill.seconds, res.tokens


def run_bench_prefix(
    model,
    system_tokens: int,
    question_tokens: int,
    requests: int,
    steps: tuple[int, ...],
    out: Path,
    progress=lambda n: None,
    seed: int = 0,
) -> dict[str, Any]:
    """Time the requests with the cache on and off for each step count; write out/bench_prefix.json and
    the PNG; return the result (`dgpipe bench prefix` prints it)."""
    from pipeline.runtime.scheduler import BlockDiffusionRuntime

    cfg = model.config
    vocab, length = cfg.text_config.vocab_size, cfg.canvas_length
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    system = draw(system_tokens)
    prompts = [system + draw(question_tokens) for _ in range(requests + 1)]  # the first: warm-up
    max_len = context_length(len(prompts[0]), OUTPUT_TOKENS, length)
    rows = []
    for n_steps in steps:
        on = BlockDiffusionRuntime(model, max_batch=1, max_len=max_len)
        off = BlockDiffusionRuntime(model, max_batch=1, max_len=max_len, prefix_cache_mib=0)
        assert on.prefix_cache is not None, "prefix caching is on by default"
        for rt in (on, off):
            _serve(rt, prompts[0], n_steps, 0)
        before = (on.prefix_cache.stats.lookup_tokens, on.prefix_cache.stats.hit_tokens)
        times: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
        identical = True
        for i, prompt in enumerate(prompts[1:], start=1):
            order = (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on))
            tokens = {}
            for name, rt in order:
                ttft, prefill, tokens[name] = _serve(rt, prompt, n_steps, i)
                times[name].append((ttft, prefill))
            identical &= tokens["on"] == tokens["off"]
            progress(1)
        med = lambda name, k, times=times: 1e3 * statistics.median(t[k] for t in times[name])
        canvas_on = 1e3 * statistics.median(ttft - prefill for ttft, prefill in times["on"])
        looked = on.prefix_cache.stats.lookup_tokens - before[0]
        hits = on.prefix_cache.stats.hit_tokens - before[1]
        rows.append(PrefixRow(n_steps, med("on", 0), med("off", 0), med("off", 0) / med("on", 0),
                              med("off", 0) / canvas_on, med("on", 1), med("off", 1), hits / looked,
                              identical))  # fmt: skip
    result = {
        "model": getattr(model, "bench_name", "model"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "machine": machine(),
        "system_tokens": system_tokens,
        "question_tokens": question_tokens,
        "requests": requests,
        "block_tokens": PREFILL_CHUNK_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "date": time.strftime("%Y-%m-%d"),
        "rows": [asdict(r) for r in rows],
    }
    save_result(out, RESULT_FILE, result)
    save_plot(out / PLOT_FILE, lambda ax: _draw(ax, rows))
    return result


def _draw(ax, rows: list[PrefixRow]) -> None:
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.ttft_off_ms for r in rows], 0.4, label="prefix cache off")
    ax.bar([i + 0.2 for i in x], [r.ttft_on_ms for r in rows], 0.4, label="prefix cache on")
    ax.set_xticks(list(x), [f"{r.steps} steps" for r in rows])
    ax.set_ylabel("median time to first canvas (ms)")
    ax.legend()


def load_bench_model(config: str | None, model_path: Path | None, threads: int):
    """Random weights of configs/models/<config>.yaml (fp32, CPU), or a checkpoint; torch threads set."""
    from pipeline.bench.model import random_model
    from pipeline.model.config import ModelConfig

    torch.set_num_threads(threads)
    if config is not None:
        m = random_model(ModelConfig.from_yaml(config), torch.float32,
                         torch.device("cpu"))  # fmt: skip
        m.bench_name = f"{config} (random weights)"
        return m
    from pipeline.runtime.session import load_session

    session = load_session(model_path)
    session.model.bench_name = str(model_path)
    return session.model


def render(r: dict) -> list[str]:
    """The `dgpipe bench prefix` table: one line per step count, prefix caching off and on."""
    lines = [
        f"{r['model']}, {r['dtype']} on {r['device']}, {r['machine']['threads']} thread(s); "
        f"{r['system_tokens']}-token shared system prompt + {r['question_tokens']}-token question, "
        f"{r['requests']} requests each way, {r['block_tokens']}-token blocks; medians",
        f"{'steps':>6}{'TTFT off ms':>13}{'TTFT on ms':>12}{'off / on':>10}{'bound':>7}{'prefill off':>13}"
        f"{'prefill on':>12}{'hit rate':>10}  tokens",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['steps']:>6}{row['ttft_off_ms']:>13.1f}{row['ttft_on_ms']:>12.1f}{row['ttft_ratio']:>10.2f}"
            f"{row['ttft_ratio_bound']:>7.2f}{row['prefill_off_ms']:>13.1f}{row['prefill_on_ms']:>12.1f}"
            f"{row['hit_rate']:>10.1%}  " + ("identical" if row["identical"] else "DIFFER")
        )
    return lines
