"""`dgpipe generate`: block diffusion in-process, or answered by a Triton server (--url); text, stream or JSON."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app()


@app.command()
def generate(
    prompt: Annotated[
        str | None,
        typer.Argument(help="prompt text (a puzzle for the embedded Sudoku model); '-' reads stdin"),
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="send the prompt as a user message through the chat template")
    ] = False,
    system: Annotated[str | None, typer.Option(help="system message (implies --chat)")] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", help='JSONL batch: a {"prompt": ...} or {"messages": [...]} per line'),
    ] = None,
    model: opt.Model = None,
    max_tokens: Annotated[int, typer.Option(help="stop after this many new tokens (no overshoot)")] = 256,
    steps: Annotated[int | None, typer.Option("--steps", help="max denoising steps per canvas")] = None,
    entropy_bound: Annotated[
        float | None, typer.Option(help="EB-sampler entropy budget per step (> 0)")
    ] = None,
    t_min: Annotated[float | None, typer.Option(help="temperature at the last step")] = None,
    t_max: Annotated[float | None, typer.Option(help="temperature at the first step")] = None,
    confidence_threshold: Annotated[
        float | None, typer.Option(help="adaptive stop below this mean entropy; 0 = fixed steps")
    ] = None,
    stability_threshold: Annotated[
        int | None, typer.Option(help="steps the argmax canvas must stay unchanged to stop")
    ] = None,
    seed: Annotated[int, typer.Option(help="request seed (counter-based RNG)")] = 0,
    canvas_length: Annotated[int | None, typer.Option(help="override the checkpoint's canvas length")] = None,
    infill: Annotated[
        str | None, typer.Option(help="canvas template: '_' marks a free position, other text is pinned")
    ] = None,
    no_infill: Annotated[bool, typer.Option("--no-infill", help="do not pin a Sudoku's givens")] = False,
    json_schema: Annotated[
        Path | None, typer.Option("--json-schema", help="constrain the output to this JSON schema (a file)")
    ] = None,
    regex: Annotated[
        str | None, typer.Option("--regex", help="constrain the output to match this regular expression")
    ] = None,
    choice: Annotated[
        str | None, typer.Option("--choice", help="constrain the output to one of these, comma-separated")
    ] = None,
    stream: Annotated[
        bool, typer.Option("--stream", help="print each committed canvas as it completes")
    ] = False,
    drafts: Annotated[bool, typer.Option("--drafts", help="show the canvas refining step by step")] = False,
    url: Annotated[
        str | None,
        typer.Option(
            help="ask a server instead: Triton http://HOST:8000 or grpc://HOST:8001, or the OpenAI API http://HOST:9000/v1"
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="DGPIPE_API_KEY", show_envvar=True, help="Bearer key of the OpenAI API (--url .../v1)"
        ),
    ] = None,
    compile: opt.Compile = False,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    as_json: opt.Json = False,
) -> None:
    """Generate with block diffusion, in-process or from a Triton server (--url)."""
    overrides = {
        "max_denoising_steps": steps,
        "entropy_bound": entropy_bound,
        "t_min": t_min,
        "t_max": t_max,
        "confidence_threshold": confidence_threshold,
        "stability_threshold": stability_threshold,
    }
    if max_tokens < 1:
        raise DgpipeError(f"--max-tokens must be >= 1 (got {max_tokens})")
    items = _inputs(prompt, chat or system is not None, system, file)  # every line checked before any work
    batch = file is not None  # --json then prints JSON Lines: one compact object per input, in order
    guide = _guide(json_schema, regex, choice)
    if url:
        for item in items:
            _remote(
                url, item, max_tokens, overrides, seed, infill, stream, drafts, as_json, batch, api_key, guide
            )
        return
    _local(
        items,
        model=model,
        max_tokens=max_tokens,
        overrides=overrides,
        seed=seed,
        canvas_length=canvas_length,
        infill=infill,
        use_default_infill=not no_infill,
        stream=stream,
        drafts=drafts,
        dtype=dtype,
        device=device,
        as_json=as_json,
        compact=batch,
        guide=guide,
        compile=compile,
    )


def _guide(json_schema: Path | None, regex: str | None, choice: str | None) -> tuple[str, str] | None:
    """--json-schema / --regex / --choice as (guide type, guide); the guide is checked (compiled to a regex)
    before any model loads, so an unsupported construct is one error line naming it."""
    import json

    from pipeline.sampler.constraints import GuideSpec

    given = [
        name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice)) if v
    ]
    if len(given) > 1:
        raise DgpipeError(f"{' and '.join(given)} exclude each other: give one constraint")
    if json_schema is not None:
        if not json_schema.is_file():
            raise DgpipeError(f"--json-schema {json_schema}: no such file")
        guide = ("json_schema", json_schema.read_text())
    elif regex is not None:
        guide = ("regex", regex)
    elif choice is not None:
        guide = ("choice", json.dumps([c for c in choice.split(",") if c]))
    else:
        return None
    GuideSpec(*guide).check()
    return guide


class Item(NamedTuple):
    prompt: str  # the text (a chat's last user message): what a task format reads, what `present` shows
    messages: list | None  # chat messages, or None for a plain prompt
    where: str | None  # "FILE:LINE" for a --file line: errors about this input name it


def _inputs(prompt: str | None, chat: bool, system: str | None, file: Path | None) -> list[Item]:
    """One item per input: the argument (stdin for '-') or each non-blank line of --file."""
    import json
    import sys

    from pipeline.runtime.chat_template import chat_messages, last_user_text, parse_messages

    if (prompt is None) == (file is None):
        raise DgpipeError("give a prompt or --file PROMPTS.jsonl (one of them)")
    if file is None:
        text = sys.stdin.read() if prompt == "-" else prompt
        return [Item(text, chat_messages(text, system) if chat else None, None)]
    if not file.is_file():
        raise DgpipeError(f"--file {file}: no such file")
    items = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DgpipeError(f"{where}: not valid JSON ({e.msg})") from e
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            text = row["prompt"]
            items.append(Item(text, chat_messages(text, system) if chat else None, where))
        elif isinstance(row, dict) and "messages" in row:
            with _naming(where):
                messages = parse_messages(row["messages"])
                items.append(Item(last_user_text(messages), messages, where))
        else:
            raise DgpipeError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not items:
        raise DgpipeError(f"--file {file}: no prompts in it")
    return items


@contextmanager
def _naming(where: str | None) -> Iterator[None]:
    """A user error raised inside the block, prefixed with the input it is about ("FILE:LINE: ...")."""
    try:
        yield
    except DgpipeError as e:
        if where is None:
            raise
        raise type(e)(f"{where}: {e}") from e


def _local(
    items: list[Item],
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
    compact: bool,
    guide: tuple[str, str] | None = None,
    compile: bool = False,
) -> None:
    """Every input through one loaded session and one runtime: the requests are submitted together and
    share denoise passes (one at a time with --stream/--drafts, so the printed canvases stay in order)."""
    import torch

    from pipeline.builddir import EngineLimits
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device, canvas_length, compile=compile)
    sampler = session.sampler(**overrides)
    automaton = None if guide is None else session.compile_guide(*guide)

    def on_canvas(req: Request, tokens: list[int]) -> None:
        if stream and not as_json:
            out.line(session.decode(tokens), nl=False)

    def on_draft(req: Request, tokens: list[int], step: int) -> None:
        if not as_json:
            out.line(f"[step {step:>2}] {session.decode(tokens)!r}", err=True)

    def on_finish(res) -> None:
        if stream and not as_json:
            out.line("")  # ends the streamed answer

    requests = []
    for item in items:
        with _naming(item.where):
            prompt_ids = (
                session.encode_prompt(item.prompt)
                if item.messages is None
                else session.encode_messages(item.messages)
            )
            if infill is not None:
                template = session.build_template(infill)
            else:
                template = session.default_template(item.prompt) if use_default_infill else None
            requests.append(
                Request(
                    prompt_ids=prompt_ids,
                    max_tokens=max_tokens,
                    sampler=sampler,
                    seed=seed,
                    template=template,
                    guide=automaton,
                    on_canvas=on_canvas,
                    on_draft=on_draft if drafts else None,
                    on_finish=on_finish,
                )
            )
    one_at_a_time = stream or drafts
    runtime = BlockDiffusionRuntime(
        session.model,
        max_batch=1 if one_at_a_time else min(len(requests), EngineLimits.max_batch),
        max_len=max(_context(session, len(r.prompt_ids), max_tokens) for r in requests),
    )
    for item, req in zip(items, requests, strict=True):
        with _naming(item.where):
            runtime.validate(req)  # every input checked before any generation
    with torch.inference_mode():
        results = runtime.generate(requests)
    for item, res in zip(items, results, strict=True):
        text = session.decode(res.tokens)
        if as_json:
            secs = res.finished - res.started
            out.json_out(
                {
                    "text": text,
                    "tokens": res.tokens,
                    "prompt_tokens": len(res.request.prompt_ids),
                    "finish_reason": res.finish_reason,
                    "steps_per_canvas": res.steps_per_canvas,
                    "time_to_first_canvas_s": round(res.time_to_first_canvas, 4),
                    "total_s": round(secs, 4),
                    "tokens_per_s": round(len(res.tokens) / secs, 2) if secs > 0 else None,
                    "sampler": sampler.model_dump(),
                    "seed": seed,
                },
                compact=compact,
            )
        elif not stream:
            shown, verdict = session.prompt_format.present(item.prompt, text)
            out.line(shown)
            if verdict is not None:
                out.line(f"{verdict}; steps per canvas {res.steps_per_canvas}", err=True)


def _context(session, prompt_len: int, max_tokens: int) -> int:
    length = session.model.config.canvas_length
    canvases = -(-max_tokens // length)
    need = prompt_len + (canvases + 1) * length
    return min(max(need, prompt_len + length), session.model.cfg.max_position_embeddings)


def _print_draft(step: int, text: str) -> None:
    out.line(f"[step {step:>2}] {text!r}", err=True)  # as the in-process path prints it


def _remote(
    url: str,
    item: Item,
    max_tokens: int,
    overrides: dict[str, Any],
    seed: int,
    infill: str | None,
    stream: bool,
    drafts: bool,
    as_json: bool,
    compact: bool,
    api_key: str | None = None,
    guide: tuple[str, str] | None = None,
) -> None:
    """Same options and output as the in-process path, answered by Triton over HTTP or gRPC, or by the
    OpenAI-compatible frontend."""
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
    if guide is not None:
        options.update(guided_decoding_guide_type=guide[0], guided_decoding_guide=guide[1])
    start = time.perf_counter()
    gen = generate(
        url,
        item.prompt if item.messages is None else None,
        max_tokens=max_tokens,
        stream=stream or drafts,
        seed=seed,
        messages=item.messages,
        api_key=api_key,
        on_draft=None if as_json else _print_draft,
        **options,
    )
    try:
        while True:
            piece = next(gen)
            if stream and not as_json:
                out.line(piece, nl=False)
    except StopIteration as stop:
        reply = stop.value
    secs = time.perf_counter() - start
    if as_json:
        out.json_out(
            {
                "text": reply.text,
                "finish_reason": reply.finish_reason,
                "steps_per_canvas": reply.denoise_steps,
                "prompt_tokens": reply.num_input_tokens,
                "output_tokens": reply.num_output_tokens,
                "total_s": round(secs, 4),
                "url": url,
            },
            compact=compact,
        )
    elif stream:
        out.line("")
    else:
        out.line(reply.text)
