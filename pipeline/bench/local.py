"""`dgpipe bench local`: in-process speed of dgpipe's runtime, side by side with transformers' `generate`
and with autoregressive decoding of the same weights, measured in one run (medians of repeated runs)."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.results import save_result
from pipeline.limits import context_length
from pipeline.model.config import SamplerConfig


@dataclass
class Sample:
    """One timed run: wall time, tokens out, model passes, canvases, seconds inside passes, first tokens."""

    total: float
    tokens: float
    passes: float
    canvases: float
    pass_seconds: float
    ttft: float


@dataclass
class Row:
    system: str
    policy: str
    tokens: float
    passes_per_canvas: float
    tokens_per_pass: float
    ms_per_pass: float
    ms_per_canvas: float
    ttft_ms: float
    tokens_per_s: float
    ms_total: float
    runs: list[float] = field(default_factory=list)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class PassTimer:
    """Wall time spent inside one model method (the denoise pass), across calls."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name, self.orig = obj, name, getattr(obj, name)
        self.seconds, self.calls = 0.0, 0
        self.first_end: float | None = None  # perf_counter when the first call returned

    def __enter__(self) -> PassTimer:
        def timed(*a, **k):
            t = time.perf_counter()
            out = self.orig(*a, **k)
            now = time.perf_counter()
            self.seconds += now - t
            self.calls += 1
            self.first_end = self.first_end or now
            return out

        setattr(self.obj, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.obj, self.name, self.orig)


def bench_dgpipe(
    session, prompt_ids, template, sampler: SamplerConfig, max_tokens: int, runs: int, batch: int
) -> Row:
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    length = session.model.config.canvas_length
    samples = []
    for r in range(runs + 1):  # first run is warm-up
        rt = BlockDiffusionRuntime(
            session.model, max_batch=batch, max_len=context_length(len(prompt_ids), max_tokens, length)
        )
        reqs = [
            Request(
                prompt_ids=prompt_ids,
                max_tokens=max_tokens,
                sampler=sampler,
                seed=r,
                request_id=i,
                template=template,
            )
            for i in range(batch)
        ]
        with PassTimer(session.model, "denoise_soft") as timer, torch.inference_mode():
            t = time.perf_counter()
            res = rt.generate(reqs)
            total = time.perf_counter() - t
        if r == 0:
            continue
        samples.append(
            Sample(
                total=total,
                tokens=sum(len(x.tokens) for x in res),
                passes=timer.calls,
                canvases=sum(len(x.steps_per_canvas) for x in res) / batch,
                pass_seconds=timer.seconds,
                ttft=statistics.median(x.time_to_first_canvas for x in res),
            )
        )
    return _row("dgpipe diffusion", sampler, samples)


def _row(system: str, sampler: SamplerConfig | None, samples: list[Sample]) -> Row:
    if sampler is None:
        policy = "-"
    elif sampler.confidence_threshold == 0:
        policy = f"fixed {sampler.max_denoising_steps}"
    else:
        policy = f"adaptive <= {sampler.max_denoising_steps}"
    med = lambda f: _median([f(x) for x in samples])
    return Row(
        system=system,
        policy=policy,
        tokens=med(lambda x: x.tokens),
        passes_per_canvas=med(lambda x: x.passes / x.canvases),
        tokens_per_pass=med(lambda x: x.tokens / x.passes),
        ms_per_pass=1000 * med(lambda x: x.pass_seconds / x.passes),
        ms_per_canvas=1000 * med(lambda x: x.total / x.canvases),
        ttft_ms=1000 * med(lambda x: x.ttft),
        tokens_per_s=med(lambda x: x.tokens / x.total),
        ms_total=1000 * med(lambda x: x.total),
        runs=[round(1000 * x.total, 2) for x in samples],
    )


class FirstTokens:
    """A transformers streamer that only notes when each put() arrives (put 0 is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_transformers(
    path: Path, prompt_ids, sampler: SamplerConfig, max_tokens: int, runs: int, batch: int
) -> Row:
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids] * batch)
    pad = ref.config.text_config.pad_token_id
    samples = []
    for r in range(runs + 1):
        torch.manual_seed(r)
        with PassTimer(ref.model.decoder, "forward") as timer, torch.inference_mode():
            t = time.perf_counter()
            streamer = FirstTokens()
            out = ref.generate(
                ids, max_new_tokens=max_tokens, streamer=streamer, **sampler.transformers_kwargs()
            )
            total = time.perf_counter() - t
        if r == 0:
            continue
        new = out.sequences[:, len(prompt_ids) :]
        canvases = new.shape[1] / ref.config.canvas_length
        first = streamer.times[1] - t if len(streamer.times) > 1 else total
        samples.append(Sample(total, int((new != pad).sum()), timer.calls, canvases, timer.seconds, first))
    return _row("transformers generate", sampler, samples)


def bench_ar(session, prompt_ids, template, max_tokens: int, runs: int, batch: int) -> Row:
    from pipeline.runtime.autoregressive import ar_generate

    samples = []
    for r in range(runs + 1):
        with PassTimer(session.model, "encode") as timer:
            t = time.perf_counter()
            outs, _ = ar_generate(
                session.model, [prompt_ids] * batch, max_tokens, [template] * batch if template else None
            )
            total = time.perf_counter() - t
        if r:
            toks = sum(len(o) for o in outs)
            first = (timer.first_end or t) - t  # prefill: its logits give the first token
            samples.append(Sample(total, toks, timer.calls, 1.0, timer.seconds, first))
    row = _row("dgpipe autoregressive", None, samples)
    row.passes_per_canvas = row.ms_per_canvas = float("nan")
    return row


def machine() -> dict[str, Any]:
    info = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


RESULT_FILE = "bench_local.json"


def run_bench_local(
    model, runs: int, batch: int, reference: bool, out: Path, dtype: str, device: str
) -> dict[str, Any]:
    """Time each system, write out/bench_local.json and return the result (`dgpipe bench local` prints it)."""
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device)
    prompt = session.prompt_format.example_prompt
    prompt_ids = session.encode_prompt(prompt)
    template = session.default_template(prompt)
    # a pinned template fills one canvas; free text gets two
    max_tokens = session.model.config.canvas_length * (1 if template is not None else 2)
    policies = [session.sampler(confidence_threshold=0.0, max_denoising_steps=16), session.sampler()]
    rows: list[Row] = []
    for sampler in policies:
        rows.append(bench_dgpipe(session, prompt_ids, template, sampler, max_tokens, runs, batch))
        if reference:
            # transformers has no infill: it generates the whole canvas (same passes, same canvas length)
            rows.append(
                bench_transformers(session.checkpoint.path, prompt_ids, sampler, max_tokens, runs, batch)
            )
    rows.append(bench_ar(session, prompt_ids, template, max_tokens, runs, batch))
    result = {
        "model": str(session.checkpoint.path),
        "dtype": str(next(session.model.parameters()).dtype),
        "device": str(next(session.model.parameters()).device),
        "batch": batch,
        "runs": runs,
        "max_tokens": max_tokens,
        "machine": machine(),
        "rows": [asdict(r) for r in rows],
    }
    save_result(out, RESULT_FILE, result)
    return result
