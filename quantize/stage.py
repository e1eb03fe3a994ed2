"""The quantize stage of a build directory: BUILD_DIR/checkpoint from the source model, recorded in the
build manifest like every other stage, so `dgpipe quantize --build-dir` and `dgpipe build` are one code path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pipeline.builddir import (
    LAYOUT,
    MANIFEST_NAME,
    BuildManifest,
    holding_build_dir,
    load_or_create,
    record_stage,
)
from pipeline.model.validate import ValidatedCheckpoint, validate_checkpoint
from pipeline.stages import StageResult
from quantize.run import Phases, QuantizeOptions, QuantizeResult, quantize_checkpoint

STAGE = "quantize"


@holding_build_dir
def quantize_stage(
    opts: QuantizeOptions,
    build_dir: Path,
    progress: Callable[[int], None] | None = None,
    source: ValidatedCheckpoint | None = None,
    phases: Phases | None = None,
) -> StageResult:
    """Quantize `opts.model` into the build dir's checkpoint (opts.output is ignored) and record the stage.
    A build dir that already holds another precision is refused before any work. `source` is the model as
    the caller validated it (weights read); without it the source is validated here, once, and the same
    pass gives the manifest its content hash."""
    build_dir = Path(build_dir).resolve()
    existing = (build_dir / MANIFEST_NAME).is_file()
    if existing:
        manifest = load_or_create(build_dir, precision=opts.precision)  # another precision: refused
    source = source if source is not None else validate_checkpoint(opts.model, weights=True)
    if not existing:
        manifest = BuildManifest(
            model=str(opts.model),
            precision=opts.precision,
            targets=[opts.target] if opts.target else [],
            model_sha256=source.sha256,
        )
    out = build_dir / LAYOUT["checkpoint"]
    res = quantize_checkpoint(replace(opts, output=out), progress=progress, source=source, phases=phases)
    record_stage(
        build_dir,
        STAGE,
        {"checkpoint": out},
        inputs={"model": Path(opts.model).resolve()},
        details=res.as_dict(),
        manifest=manifest,
    )
    return stage_result(res)


def stage_result(res: QuantizeResult) -> StageResult:
    """A quantization's result as a stage result (`dgpipe quantize --output` reports it the same way)."""
    block = f", block {res.block_size}" if res.block_size else ""
    calib = (
        f", calibrated on {res.calib_prompts} prompts x {res.calib_steps} denoise steps"
        if res.calib_prompts
        else ""
    )
    line = f"{res.precision}{block}: {res.output} ({res.bytes:,} bytes{calib}, {res.seconds:.0f}s)"
    return StageResult(STAGE, {"checkpoint": Path(res.output)}, res.seconds, [line], res.as_dict())
