"""What `dgpipe generate` and `dgpipe eval sudoku` print: text, streamed canvases, drafts, or JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from pipeline.errors import DgpipeError


def run_generate(
    prompt: str,
    model: Path | None,
    max_tokens: int,
    overrides: dict[str, Any],
    seed: int,
    canvas_length: int | None,
    infill: str | None,
    use_default_infill: bool,
    stream: bool,
    drafts: bool,
    dtype: str,
    device: str,
    as_json: bool,
) -> None:
    import torch

    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device, canvas_length)
    sampler = session.sampler(**overrides)
    prompt_ids = session.encode_prompt(prompt)
    if infill is not None:
        template = session.build_template(infill)
    else:
        template = session.default_template(prompt) if use_default_infill else None

    def on_canvas(req: Request, tokens: list[int]) -> None:
        if stream and not as_json:
            typer.echo(session.decode(tokens), nl=False)

    def on_draft(req: Request, tokens: list[int], step: int) -> None:
        if not as_json:
            typer.echo(f"[step {step:>2}] {session.decode(tokens)!r}", err=True)

    req = Request(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampler=sampler,
        seed=seed,
        template=template,
        on_canvas=on_canvas,
        on_draft=on_draft if drafts else None,
    )
    runtime = BlockDiffusionRuntime(
        session.model, max_batch=1, max_len=_context(session, len(prompt_ids), max_tokens)
    )
    start = time.perf_counter()
    with torch.inference_mode():
        res = runtime.generate([req])[0]
    secs = time.perf_counter() - start
    text = session.decode(res.tokens)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "text": text,
                    "tokens": res.tokens,
                    "prompt_tokens": len(prompt_ids),
                    "finish_reason": res.finish_reason,
                    "steps_per_canvas": res.steps_per_canvas,
                    "time_to_first_canvas_s": round(res.time_to_first_canvas, 4),
                    "total_s": round(secs, 4),
                    "tokens_per_s": round(len(res.tokens) / secs, 2) if secs > 0 else None,
                    "sampler": sampler.model_dump(),
                    "seed": seed,
                },
                indent=2,
            )
        )
        return
    if stream:
        typer.echo("")
    elif session.task == "sudoku":
        from pipeline.demo import sudoku

        typer.echo(sudoku.format_grid(text))
        solved = sudoku.is_valid_solution(sudoku.parse_puzzle(prompt), text)
        typer.echo(
            f"{'solved' if solved else 'NOT a valid solution'}; steps per canvas {res.steps_per_canvas}",
            err=True,
        )
    else:
        typer.echo(text)


def _context(session, prompt_len: int, max_tokens: int) -> int:
    length = session.model.config.canvas_length
    canvases = -(-max_tokens // length)
    need = prompt_len + (canvases + 1) * length
    return min(max(need, prompt_len + length), session.model.cfg.max_position_embeddings)


def run_eval_sudoku(
    model: Path | None,
    n: int,
    givens: tuple[int, int] | None,
    decode: str,
    infill: bool,
    overrides: dict[str, Any],
    seed: int,
    batch: int,
    dtype: str,
    device: str,
    as_json: bool,
    onnx: Path | None = None,
) -> None:
    from rich.progress import Progress

    from pipeline.demo import sudoku
    from pipeline.demo.evaluate import eval_sudoku
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device)
    runner = session.model
    if onnx is not None:  # same runtime and sampler state, network + sampler step in onnxruntime
        from pipeline.onnx.backend import OnnxRuntimeBackend

        if decode != "diffusion":
            raise DgpipeError("--onnx runs diffusion decoding only", "drop --decode ar")
        runner = OnnxRuntimeBackend(onnx, session.checkpoint.path)
    if session.task != "sudoku":
        raise DgpipeError(f"{session.checkpoint.path} is not a Sudoku model (dgpipe.json task != 'sudoku')")
    if givens is None:
        givens = tuple(session.checkpoint.dgpipe.get("givens_range", (45, 61)))  # type: ignore[assignment]
    puzzles = sudoku.make_dataset(seed, n, givens)
    sampler = session.sampler(**overrides)
    with Progress(transient=True, disable=as_json) as bar:
        task = bar.add_task(f"{decode} on {n} puzzles", total=n)
        rep = eval_sudoku(
            runner,  # type: ignore[arg-type]
            puzzles,
            givens,
            sampler,
            decode=decode,
            infill=infill,
            batch=batch,
            progress=lambda k: bar.advance(task, k),
        )
    out = rep.as_dict() | {"model": str(session.checkpoint.path), "sampler": sampler.model_dump()}
    if onnx is not None:
        out["onnx"] = str(onnx)
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(
        f"{rep.decode}{' +infill' if rep.infill else ''} on {rep.n} puzzles, givens {givens[0]}-{givens[1]}: "
        f"solved {rep.solve_rate:.1%}, constraint-valid {rep.valid_rate:.1%}, "
        f"steps/canvas mean {rep.mean_steps:.1f} p90 {rep.p90_steps:.0f}, {rep.tokens_per_s:.0f} tokens/s"
    )


def run_generate_remote(
    url: str,
    prompt: str,
    max_tokens: int,
    overrides: dict[str, Any],
    seed: int,
    infill: str | None,
    stream: bool,
    drafts: bool,
    as_json: bool,
) -> None:
    """Same options and output as the in-process path, answered by Triton over HTTP or gRPC."""
    from pipeline.serving.client import generate

    options = {k: v for k, v in overrides.items() if k != "stability_threshold"}
    if overrides.get("stability_threshold") is not None:
        raise DgpipeError("--stability-threshold is a server-side setting; it cannot be sent per request")
    options.update(
        infill_template=infill,
        stream_drafts=drafts or None,
        exclude_input_in_output=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    start = time.perf_counter()
    gen = generate(url, prompt, max_tokens=max_tokens, stream=stream or drafts, seed=seed, **options)
    try:
        while True:
            piece = next(gen)
            if stream and not as_json:
                typer.echo(piece, nl=False)
    except StopIteration as stop:
        reply = stop.value
    secs = time.perf_counter() - start
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "text": reply.text,
                    "finish_reason": reply.finish_reason,
                    "steps_per_canvas": reply.denoise_steps,
                    "prompt_tokens": reply.num_input_tokens,
                    "output_tokens": reply.num_output_tokens,
                    "total_s": round(secs, 4),
                    "url": url,
                },
                indent=2,
            )
        )
    elif stream:
        typer.echo("")
    else:
        typer.echo(reply.text)
