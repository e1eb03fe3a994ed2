"""`dgpipe generate`: block diffusion in-process, or answered by a Triton server (--url); text, stream or JSON."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pipeline import endpoints
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError
from pipeline.limits import DEFAULT_MAX_TOKENS

app = opt.typer_app()

Prompt = Annotated[
    str | None,
    typer.Argument(help="prompt text (a puzzle for the embedded Sudoku model); '-' reads stdin"),
]
Chat = Annotated[
    bool, typer.Option("--chat", help="send the prompt as a user message through the chat template")
]
System = Annotated[str | None, typer.Option(help="system message (implies --chat)")]
File = Annotated[
    Path | None,
    typer.Option("--file", help='JSONL batch: a {"prompt": ...} or {"messages": [...]} per line'),
]
MaxTokens = Annotated[int, typer.Option(help="stop after this many new tokens (no overshoot)")]
Steps = Annotated[int | None, typer.Option("--steps", help="max denoising steps per canvas")]
EntropyBound = Annotated[float | None, typer.Option(help="EB-sampler entropy budget per step (> 0)")]
TMin = Annotated[float | None, typer.Option(help="temperature at the last step")]
TMax = Annotated[float | None, typer.Option(help="temperature at the first step")]
Confidence = Annotated[
    float | None, typer.Option(help="adaptive stop below this mean entropy; 0 = fixed steps")
]
Stability = Annotated[int | None, typer.Option(help="steps the argmax canvas must stay unchanged to stop")]
Seed = Annotated[int, typer.Option(help="request seed (counter-based RNG)")]
CanvasLength = Annotated[int | None, typer.Option(help="override the checkpoint's canvas length")]
Infill = Annotated[
    str | None, typer.Option(help="canvas template: '_' marks a free position, other text is pinned")
]
NoInfill = Annotated[bool, typer.Option("--no-infill", help="do not pin a Sudoku's givens")]
JsonSchema = Annotated[
    Path | None, typer.Option("--json-schema", help="constrain the output to this JSON schema (a file)")
]
Regex = Annotated[
    str | None, typer.Option("--regex", help="constrain the output to match this regular expression")
]
Choice = Annotated[
    str | None, typer.Option("--choice", help="constrain the output to one of these, comma-separated")
]
Stream = Annotated[bool, typer.Option("--stream", help="print each committed canvas as it completes")]
Drafts = Annotated[bool, typer.Option("--drafts", help="show the canvas refining step by step")]
Url = Annotated[
    str | None,
    typer.Option(
        help=f"ask a server instead: Triton http://HOST:{endpoints.HTTP_PORT} or grpc://HOST:{endpoints.GRPC_PORT}, "
        f"or the OpenAI API http://HOST:{endpoints.OPENAI_PORT}/v1"
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="DGPIPE_API_KEY", show_envvar=True, help="Bearer key of the OpenAI API (--url .../v1)"
    ),
]
ServedName = Annotated[
    str,
    typer.Option(
        "--name",
        envvar=endpoints.MODEL_NAME_ENV,
        show_envvar=True,
        help="with --url: the served model's name (`dgpipe build/package --name`)",
    ),
]


@app.command()
def generate(
    prompt: Prompt = None,
    chat: Chat = False,
    system: System = None,
    file: File = None,
    model: opt.Model = None,
    adapter: opt.Adapter = None,
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS,
    steps: Steps = None,
    entropy_bound: EntropyBound = None,
    t_min: TMin = None,
    t_max: TMax = None,
    confidence_threshold: Confidence = None,
    stability_threshold: Stability = None,
    seed: Seed = 0,
    canvas_length: CanvasLength = None,
    infill: Infill = None,
    no_infill: NoInfill = False,
    json_schema: JsonSchema = None,
    regex: Regex = None,
    choice: Choice = None,
    stream: Stream = False,
    drafts: Drafts = False,
    url: Url = None,
    api_key: ApiKey = None,
    name: ServedName = endpoints.MODEL_NAME,
    compile: opt.Compile = False,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    as_json: opt.Json = False,
) -> None:
    """Generate with block diffusion, in-process or from a Triton server (--url)."""
    from pipeline.runtime import batch

    _refuse_local_options(url, model, adapter, compile, dtype, device)
    text = sys.stdin.read() if prompt == "-" else prompt
    inputs = batch.read_inputs(text, chat or system is not None, system, file)  # all checked before work
    settings = batch.GenerateSettings(
        model=opt.model_dir(model, adapter),
        max_tokens=max_tokens,
        sampler={
            "max_denoising_steps": steps,
            "entropy_bound": entropy_bound,
            "t_min": t_min,
            "t_max": t_max,
            "confidence_threshold": confidence_threshold,
            "stability_threshold": stability_threshold,
        },
        seed=seed,
        canvas_length=canvas_length,
        infill=infill,
        default_infill=not no_infill,
        guide=batch.parse_guide(json_schema, regex, choice),
        stream=stream,
        drafts=drafts,
        dtype=dtype,
        device=device,
        compile=compile,
    )
    _run(inputs, settings, url, api_key, name, as_json, compact=file is not None)


def _refuse_local_options(url, model, adapter, compile: bool, dtype: str, device: str) -> None:
    """With --url the server's model, dtype and device serve the request: these would be silently ignored."""
    if not url:
        return
    local = {"--model": model, "--adapter": adapter, "--compile": compile or None}
    local |= {"--dtype": None if dtype == "auto" else dtype, "--device": None if device == "auto" else device}
    given = [flag for flag, value in local.items() if value is not None]
    if given:
        raise DgpipeError(
            f"{', '.join(given)} with --url: the server's model runs there, not one loaded here",
            "leave them out, or leave out --url to generate in-process",
        )


def _run(
    inputs, settings, url: str | None, api_key: str | None, name: str, as_json: bool, compact: bool
) -> None:
    """In-process or remote, then one printout per input (`compact`: --json prints JSON Lines, one
    compact object per input, in order)."""
    from pipeline.runtime.batch import generate_batch

    callbacks = _callbacks(settings, as_json)
    if url:
        from pipeline.serving.remote import generate_remote

        for item in inputs:  # each answer printed as it arrives
            reply = generate_remote(url, item, settings, api_key, callbacks, model=name)
            _print(reply, settings, as_json, compact)
        return
    for result in generate_batch(inputs, settings, callbacks):
        _print(result, settings, as_json, compact)


def _callbacks(settings, as_json: bool):
    """What is printed while generating: streamed pieces on stdout, drafts on stderr (none with --json)."""
    from pipeline.runtime.batch import Callbacks

    if as_json:
        return Callbacks()
    return Callbacks(
        on_piece=(lambda text: out.line(text, nl=False)) if settings.stream else None,
        on_draft=(lambda step, text: out.line(f"[step {step:>2}] {text!r}", err=True))
        if settings.drafts
        else None,
        on_done=(lambda: out.line("")) if settings.stream else None,  # ends the streamed answer
    )


def _print(result, settings, as_json: bool, compact: bool) -> None:
    """--json: the result's figures; a stream was printed already; else the answer (as the prompt format
    shows it in-process, with its verdict on stderr)."""
    from pipeline.runtime.batch import GenerateOutput

    if as_json:
        out.json_out(result.as_dict(), compact=compact)
    elif settings.stream:
        return
    elif isinstance(result, GenerateOutput):
        out.line(result.shown)
        if result.verdict is not None:
            out.line(f"{result.verdict}; steps per canvas {result.steps_per_canvas}", err=True)
    else:
        out.line(result.text)
