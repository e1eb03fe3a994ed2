"""`dgpipe bench local`: in-process speed of dgpipe's runtime, side by side with transformers' `generate`
and with autoregressive decoding of the same weights, measured in one run (medians of repeated runs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.machine import machine
from pipeline.bench.plots import local_plot
from pipeline.bench.results import save_result
from pipeline.bench.timing import sync
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
    """Wall time spent inside one model method (the denoise pass), across calls; on CUDA the device is
    synchronised around each call, so the time is the work's, not its launch's."""

    def __init__(self, obj: Any, name: str, device: torch.device | None = None) -> None:
        self.obj, self.name, self.orig = obj, name, getattr(obj, name)
        self.device = device
        self.seconds, self.calls = 0.0, 0
        self.first_end: float | None = None  # perf_counter when the first call returned

    def __enter__(self) -> PassTimer:
        def timed(*a, **k):
            sync(self.device)
            t = time.perf_counter()
            out = self.orig(*a, **k)
            sync(self.device)
            now = time.perf_counter()
            self.seconds += now - t
            self.calls += 1
            self.first_end = self.first_end or now
            return out

        setattr(self.obj, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.obj, self.name, self.orig)


Runner = Callable[[int], Sample]  # one timed run with the given seed


def dgpipe_runner(
    session, prompt_ids, template, sampler: SamplerConfig, max_tokens: int, batch: int
) -> Runner:
    """dgpipe's runtime generating `batch` copies of the prompt (a fresh runtime per run)."""
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    length = session.model.config.canvas_length
    device = next(session.model.parameters()).device

    def run(seed: int) -> Sample:
        rt = BlockDiffusionRuntime(
            session.model, max_batch=batch, max_len=context_length(len(prompt_ids), max_tokens, length)
        )
        reqs = [
            Request(prompt_ids=prompt_ids, max_tokens=max_tokens, sampler=sampler, seed=seed, request_id=i,
                    template=template)
            for i in range(batch)
        ]  # fmt: skip
        with PassTimer(session.model, "denoise_soft", device) as timer, torch.inference_mode():
            t = time.perf_counter()
            res = rt.generate(reqs)  # its tokens are on the host: the device's work is done
            total = time.perf_counter() - t
        return Sample(
            total=total,
            tokens=sum(len(x.tokens) for x in res),
            passes=timer.calls,
            canvases=sum(len(x.steps_per_canvas) for x in res) / batch,
            pass_seconds=timer.seconds,
            ttft=statistics.median(x.time_to_first_canvas for x in res),
        )

    return run


def interleaved(runners: dict[str, Runner], runs: int) -> dict[str, list[Sample]]:
    """`runs` timed runs of each system, one of each per round in turn (after a warm-up round), so a load
    that comes and goes on a shared machine falls on every system alike."""
    samples: dict[str, list[Sample]] = {name: [] for name in runners}
    for r in range(runs + 1):  # round 0 warms every system up
        for name, run in runners.items():
            sample = run(r)
            if r:
                samples[name].append(sample)
    return samples


def policy_name(sampler: SamplerConfig | None) -> str:
    """The step policy as tables print it: fixed N steps, or adaptive up to N; "-" for no sampler (AR)."""
    if sampler is None:
        return "-"
    if sampler.confidence_threshold == 0:
        return f"fixed {sampler.max_denoising_steps}"
    return f"adaptive <= {sampler.max_denoising_steps}"


def median_row(system: str, sampler: SamplerConfig | None, samples: list[Sample]) -> Row:
    """The system's row: each figure the median over its runs (ratios are taken per run, then their median)."""
    policy = policy_name(sampler)
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


def transformers_runner(
    path: Path, dtype: torch.dtype, device: torch.device, prompt_ids, max_tokens: int, batch: int
) -> Callable[[SamplerConfig], Runner]:
    """transformers' `generate` on the same checkpoint, loaded once in dgpipe's dtype and device (the same
    arithmetic on the same hardware), for each sampler policy."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt_ids] * batch, device=device)
    pad = ref.config.text_config.pad_token_id

    def policy(sampler: SamplerConfig) -> Runner:
        def run(seed: int) -> Sample:
            torch.manual_seed(seed)
            with PassTimer(ref.model.decoder, "forward", device) as timer, torch.inference_mode():
                sync(device)
                t = time.perf_counter()
                streamer = FirstTokens()
                out = ref.generate(
                    ids, max_new_tokens=max_tokens, streamer=streamer, **sampler.transformers_kwargs()
                )
                sync(device)
                total = time.perf_counter() - t
            new = out.sequences[:, len(prompt_ids) :]
            canvases = new.shape[1] / ref.config.canvas_length
            first = streamer.times[1] - t if len(streamer.times) > 1 else total
            return Sample(total, int((new != pad).sum()), timer.calls, canvases, timer.seconds, first)

        return run

    return policy


def ar_runner(session, prompt_ids, template, max_tokens: int, batch: int) -> Runner:
    """Autoregressive decoding of the same weights (one token per pass)."""
    from pipeline.runtime.autoregressive import ar_generate

    device = next(session.model.parameters()).device

    def run(seed: int) -> Sample:
        with PassTimer(session.model, "encode", device) as timer:
            t = time.perf_counter()
            outs, _ = ar_generate(
                session.model, [prompt_ids] * batch, max_tokens, [template] * batch if template else None
            )
            total = time.perf_counter() - t
        first = (timer.first_end or t) - t  # prefill: its logits give the first token
        return Sample(total, sum(len(o) for o in outs), timer.calls, 1.0, timer.seconds, first)

    return run


RESULT_FILE, PLOT_FILE = "bench_local.json", "bench_local.png"


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
    param = next(session.model.parameters())
    reference_policy = (
        transformers_runner(session.checkpoint.path, param.dtype, param.device, prompt_ids, max_tokens, batch)
        if reference
        else None
    )
    systems: list[tuple[str, SamplerConfig | None, Runner]] = []
    for sampler in policies:
        systems.append(
            (
                "dgpipe diffusion",
                sampler,
                dgpipe_runner(session, prompt_ids, template, sampler, max_tokens, batch),
            )
        )
        if reference_policy is not None:
            # transformers has no infill: it generates the whole canvas (same passes, same canvas length)
            systems.append(("transformers generate", sampler, reference_policy(sampler)))
    systems.append(
        ("dgpipe autoregressive", None, ar_runner(session, prompt_ids, template, max_tokens, batch))
    )
    samples = interleaved({str(i): run for i, (_, _, run) in enumerate(systems)}, runs)
    rows = [median_row(name, sampler, samples[str(i)]) for i, (name, sampler, _) in enumerate(systems)]
    rows[-1].passes_per_canvas = rows[-1].ms_per_canvas = float("nan")  # AR has no canvases
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
    local_plot(result, out / PLOT_FILE)
    return result


def render(result: dict) -> list[str]:
    """The `dgpipe bench local` table: one line per system and policy, medians."""
    header = (
        f"{result['model']}  {result['dtype']} on {result['device']}, batch {result['batch']}, "
        f"medians of {result['runs']} runs\n"
        f"{'system':<24}{'steps':<16}{'tokens':>7}{'passes/canvas':>14}{'tok/pass':>9}{'ms/pass':>9}"
        f"{'ms/canvas':>10}{'TTFT ms':>9}{'tokens/s':>10}"
    )
    return [header] + [
        f"{r['system']:<24}{r['policy']:<16}{r['tokens']:>7.0f}{r['passes_per_canvas']:>14.1f}"
        f"{r['tokens_per_pass']:>9.2f}{r['ms_per_pass']:>9.2f}{r['ms_per_canvas']:>10.1f}{r['ttft_ms']:>9.1f}"
        f"{r['tokens_per_s']:>10.1f}"
        for r in result["rows"]
    ]
