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
import typer

from pipeline.config import SamplerConfig
from pipeline.results import save_result

SUDOKU_PROMPT = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"  # make_dataset(2026, 1, (50, 50)): unique solution


@dataclass
class Row:
    system: str
    policy: str
    tokens: float
    passes_per_canvas: float
    ms_per_pass: float
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

    def __enter__(self) -> PassTimer:
        def timed(*a, **k):
            t = time.perf_counter()
            out = self.orig(*a, **k)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out

        setattr(self.obj, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.obj, self.name, self.orig)


def bench_dgpipe(
    session, prompt_ids, template, sampler: SamplerConfig, max_tokens: int, runs: int, batch: int
) -> Row:
    from pipeline.runtime import BlockDiffusionRuntime, Request

    length = session.model.config.canvas_length
    samples = []
    for r in range(runs + 1):  # first run is warm-up
        rt = BlockDiffusionRuntime(
            session.model, max_batch=batch, max_len=len(prompt_ids) + max_tokens + 2 * length
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
        with PassTimer(session.model, "denoise") as timer, torch.inference_mode():
            t = time.perf_counter()
            res = rt.generate(reqs)
            total = time.perf_counter() - t
        if r == 0:
            continue
        toks = sum(len(x.tokens) for x in res)
        canvases = sum(len(x.steps_per_canvas) for x in res) / batch
        samples.append((total, toks, timer.calls / canvases, timer.seconds / max(timer.calls, 1)))
    return _row("dgpipe diffusion", sampler, samples)


def _row(system: str, sampler: SamplerConfig | None, samples: list[tuple[float, float, float, float]]) -> Row:
    policy = (
        "-"
        if sampler is None
        else (
            f"fixed {sampler.max_denoising_steps}"
            if sampler.confidence_threshold == 0
            else f"adaptive <= {sampler.max_denoising_steps}"
        )
    )
    return Row(
        system=system,
        policy=policy,
        tokens=_median([s[1] for s in samples]),
        passes_per_canvas=_median([s[2] for s in samples]),
        ms_per_pass=1000 * _median([s[3] for s in samples]),
        tokens_per_s=_median([s[1] / s[0] for s in samples]),
        ms_total=1000 * _median([s[0] for s in samples]),
        runs=[round(1000 * s[0], 2) for s in samples],
    )


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
            out = ref.generate(ids, max_new_tokens=max_tokens, **sampler.transformers_kwargs())
            total = time.perf_counter() - t
        if r == 0:
            continue
        new = out.sequences[:, len(prompt_ids) :]
        toks = int((new != pad).sum())
        canvases = new.shape[1] / ref.config.canvas_length
        samples.append((total, toks, timer.calls / canvases, timer.seconds / max(timer.calls, 1)))
    return _row("transformers generate", sampler, samples)


def bench_ar(session, prompt_ids, template, max_tokens: int, runs: int, batch: int) -> Row:
    from pipeline.ar import ar_generate

    samples = []
    for r in range(runs + 1):
        with PassTimer(session.model, "encode") as timer:
            t = time.perf_counter()
            outs, _ = ar_generate(
                session.model, [prompt_ids] * batch, max_tokens, [template] * batch if template else None
            )
            total = time.perf_counter() - t
        if r:
            samples.append((total, sum(len(o) for o in outs), 1.0, timer.seconds / max(timer.calls, 1)))
    row = _row("dgpipe autoregressive", None, samples)
    row.passes_per_canvas = float("nan")
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


def run_bench_local(
    model, runs: int, batch: int, reference: bool, out: Path, dtype: str, device: str, as_json: bool
) -> None:
    from pipeline.session import load_session

    session = load_session(model, dtype, device)
    sudoku = session.task == "sudoku"
    prompt = SUDOKU_PROMPT if sudoku else "The quick brown fox"
    prompt_ids = session.encode_prompt(prompt)
    template = session.default_template(prompt) if sudoku else None
    max_tokens = session.model.config.canvas_length if sudoku else 2 * session.model.config.canvas_length
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
    if save_result(out, "bench_local.json", result, as_json):
        return
    typer.echo(
        f"{result['model']}  {result['dtype']} on {result['device']}, batch {batch}, medians of {runs} runs"
    )
    typer.echo(
        f"{'system':<24}{'steps':<16}{'tokens':>7}{'passes/canvas':>15}{'ms/pass':>9}{'tokens/s':>10}{'ms total':>10}"
    )
    for r in rows:
        typer.echo(
            f"{r.system:<24}{r.policy:<16}{r.tokens:>7.0f}{r.passes_per_canvas:>15.1f}{r.ms_per_pass:>9.2f}{r.tokens_per_s:>10.1f}{r.ms_total:>10.1f}"
        )
    typer.echo(f"results: {out / 'bench_local.json'}")
