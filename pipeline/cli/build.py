"""`dgpipe build`: every stage into one build dir, recorded in BUILD_DIR/build_manifest.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out

app = opt.typer_app()


@app.command()
def build(
    model: opt.Model = None,
    adapter: opt.Adapter = None,
    precision: Annotated[str, typer.Option(help="nvfp4, fp8, int4_awq or bf16")] = "nvfp4",
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
    max_prompt_bytes: opt.MaxPromptBytes = None,
    max_guide_bytes: opt.MaxGuideBytes = None,
    max_guide_seconds: opt.MaxGuideSeconds = None,
    max_guide_memory_mib: opt.MaxGuideMemoryMib = None,
    as_json: opt.Json = False,
) -> None:
    """Run every stage: quantize -> export ONNX -> sampler PTX + TensorRT engines (here, or the step for the
    target node) -> Triton model repository, recorded in BUILD_DIR/build_manifest.json."""
    from pipeline.build import BuildOptions, run_build
    from pipeline.runtime.session import default_model_path

    opts = BuildOptions(
        model=opt.model_dir(model, adapter) or default_model_path(),
        precision=precision,
        build_dir=build_dir or opt.cache_dir() / "build",
        targets=[t for item in target or [] for t in item.split(",") if t],
        calib_size=calib_size,
        calib_data=calib_data,
        limits=opt.limits(
            max_batch=max_batch,
            max_prompt=max_prompt,
            max_context=max_context,
            max_tokens=max_tokens,
            max_steps=max_steps,
            max_request_seconds=max_request_seconds,
            max_prompt_bytes=max_prompt_bytes,
            max_guide_bytes=max_guide_bytes,
            max_guide_seconds=max_guide_seconds,
            max_guide_memory_mib=max_guide_memory_mib,
        ),
    )
    with out.spinner("building", err=as_json) as say:
        summary = run_build(opts, say=say)
    if as_json:
        out.json_out(summary)
