"""`dgpipe build`: every stage into one build dir, recorded in BUILD_DIR/build_manifest.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.endpoints import MODEL_NAME

app = opt.typer_app()

LOG_NAME = "build.log"  # third-party output of a build, in its build dir (pipeline/cli/capture.py)


@app.command()
def build(
    model: opt.Model = None,
    adapter: opt.Adapter = None,
    precision: Annotated[str, opt.precision()] = "nvfp4",
    name: opt.ModelName = MODEL_NAME,
    target: Annotated[
        list[str] | None,
        typer.Option(help="GPU target (sm90, sm100, sm120; repeatable); default: all that run the precision"),
    ] = None,
    build_dir: Annotated[
        Path | None,
        opt.build_dir("where every stage writes (build_manifest.json); " + opt.in_cache("build")),
    ] = None,
    calib_size: opt.CalibSize = opt.CALIB_SIZE,
    calib_data: Annotated[Path | None, typer.Option(help='JSONL calibration prompts ({"text": ...})')] = None,
    max_batch: opt.MaxBatch = None,
    max_prompt: opt.MaxPrompt = None,
    max_context: opt.MaxContext = None,
    max_tokens: opt.MaxTokens = None,
    max_steps: opt.MaxSteps = None,
    max_request_seconds: opt.MaxRequestSeconds = None,
    max_queue: opt.MaxQueue = None,
    max_prompt_bytes: opt.MaxPromptBytes = None,
    max_guide_bytes: opt.MaxGuideBytes = None,
    max_regex_positions: opt.MaxRegexPositions = None,
    max_guide_seconds: opt.MaxGuideSeconds = None,
    max_guide_memory_mib: opt.MaxGuideMemoryMib = None,
    prefix_cache_mib: opt.PrefixCacheMib = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="show third-party output live (it always goes to build.log)"),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="stream the build's events as JSON lines on stdout")
    ] = False,
) -> None:
    """Run every stage: quantize -> export ONNX -> sampler PTX + TensorRT engines (here, or the step for the
    target node) -> Triton model repository, recorded in BUILD_DIR/build_manifest.json."""
    from pipeline.limits import Limits

    # the limit options, by their one name (None: the default)
    limits = opt.limits(**{k: v for k, v in locals().items() if k in Limits.model_fields})
    out_dir = build_dir or opt.cache_dir() / "build"
    _watched(
        out_dir,
        as_json,
        verbose,
        lambda view: _run(
            view, out_dir, model, adapter, precision, name, target, calib_size, calib_data, limits
        ),
    )


def _watched(out_dir: Path, as_json: bool, verbose: bool, run) -> None:
    """Run the build with its third-party output captured to build.log and its events shown (a live view,
    or JSON lines with --json); a Ctrl-C says how to resume, and with --json a failure is an event too
    (its line also goes to stderr, as for every command)."""
    from pipeline.cli import errors
    from pipeline.cli.build_view import ConsoleView, JsonView
    from pipeline.cli.capture import capture

    view: ConsoleView | JsonView | None = None
    echo = (lambda line: view.echo(line) if isinstance(view, ConsoleView) else None) if verbose else None
    with capture(out_dir / LOG_NAME, echo=echo) as cap:  # first: what the imports below say goes to the log
        view = JsonView(cap.stdout) if as_json else ConsoleView(cap.stdout)
        try:
            run(view)
        except KeyboardInterrupt:
            view.close()
            view.note(
                event="interrupted",
                text="interrupted: run the same command to resume (finished stages are kept)",
            )
            raise
        except Exception as e:  # the mapped errors (exit 2) and any other (exit 1, with its traceback)
            if as_json:
                code, line = errors.mapped(e)
                view.note(event="build_failed", error=line.removeprefix("error: "), exit_code=code)
            raise
        finally:
            view.close()
    if cap.lines:
        where = f"{cap.log}" if cap.log.is_file() else "the console above"
        text = f"{cap.lines} lines of third-party output in {where} (-v shows them live)"
        if as_json:
            out.json_out({"event": "log", "path": str(cap.log), "lines": cap.lines}, compact=True)
        else:
            out.line(text)


def _run(view, build_dir, model, adapter, precision, name, target, calib_size, calib_data, limits) -> None:
    from pipeline.build import BuildOptions, run_build
    from pipeline.resources import EMBEDDED_MODEL  # not runtime.session: torch would delay the first line

    opts = BuildOptions(
        # a missing one is refused by the build's first check
        model=opt.model_dir(model, adapter) or EMBEDDED_MODEL,
        precision=precision,
        name=name,
        build_dir=build_dir,
        targets=[t for item in target or [] for t in item.split(",") if t],
        calib_size=calib_size,
        calib_data=calib_data,
        limits=limits,
    )
    run_build(opts, emit=view)
