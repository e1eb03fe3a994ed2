"""`dgpipe build`: checkpoint -> quantized checkpoint -> ONNX -> sampler PTX + engines -> Triton repository.

Each stage is the same code its own command runs (`dgpipe quantize`, `export`, `engine build`, `package`),
reading the previous stage's output from the build directory and recording itself in the build manifest,
so a failed build resumes from the stage that failed with the same commands a user would type. Engines
are built here only where TensorRT and a GPU of the target exist; otherwise the build records the exact
`dgpipe engine build` command that the serving image runs on the target node (the Kubernetes
initContainer rendered by `dgpipe manifests`) and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.builddir import (
    LAYOUT,
    load_or_create,
    save_manifest,
)
from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.stages import StageResult
from quantize.defaults import CALIB_SIZE

if TYPE_CHECKING:
    from pipeline.model.validate import ValidatedCheckpoint

DEFAULT_TARGETS = ("sm90", "sm100", "sm120")  # the architectures the engines and kernels are built for


@dataclass
class BuildOptions:
    model: Path
    precision: str
    build_dir: Path
    targets: list[str] = field(default_factory=list)  # empty: every default target that runs `precision`
    calib_size: int = CALIB_SIZE
    calib_data: Path | None = None
    # the engine is built for its engine caps; the repository admits what its serving caps allow, the
    # same values `dgpipe package --build-dir` writes (both read them back from the build's record)
    limits: Limits = field(default_factory=Limits)


def resolve_targets(precision: str, requested: list[str]) -> list[str]:
    """Requested targets are checked against the precision rules; by default, every engine architecture
    on which the precision runs natively (nvfp4: Blackwell only)."""
    from pipeline.targets import check_precision_on_target, target
    from pipeline.targets import precision as get_precision

    get_precision(precision)  # unknown precision: a clear error before anything else
    if requested:
        names = [target(t).name for t in requested]
        for name in names:
            check_precision_on_target(precision, name)
        return list(dict.fromkeys(names))
    return [t for t in DEFAULT_TARGETS if precision in target(t).precisions]


def run_build(opts: BuildOptions, say: Callable[[str], None]) -> dict:
    """Every stage in order on one build dir; `say` gets each stage's summary lines as it finishes. Returns
    the build's summary: its dir, precision, targets and each stage's result by stage name."""
    from pipeline.deploy.smoke import smoke_test_for
    from pipeline.model.validate import validate_checkpoint

    if opts.limits.max_context <= opts.limits.max_prompt:
        raise DgpipeError("--max-context must be > --max-prompt")
    targets = resolve_targets(opts.precision, opts.targets)
    # a missing, broken or hostile checkpoint fails before any stage runs or anything is written; the
    # one pass over its weights also gives the content hash, and the quantize stage takes this value
    source = validate_checkpoint(opts.model, weights=True, limits=opts.limits)
    opts.limits.validate(source.config.canvas_length)  # the engines and the repository, before any stage
    opts.limits.check_fits(source.config.canvas_length)
    build_dir = opts.build_dir.resolve()
    man = load_or_create(
        build_dir,
        model=str(opts.model),
        precision=opts.precision,
        targets=targets,
        model_sha256=source.sha256,
    )
    man.smoke = smoke_test_for(source).as_dict()  # what `dgpipe manifests` renders into the smoke Job
    save_manifest(build_dir, man)
    say(f"build {build_dir}: {opts.model} -> {opts.precision} for {', '.join(targets)}")
    summary: dict[str, object] = {
        "build_dir": str(build_dir),
        "precision": opts.precision,
        "targets": targets,
    }
    stages = (partial(_quantize, source=source), _export, _engines, _package)
    for stage in stages:  # each reads what the one before wrote
        result = stage(opts, build_dir)
        for line in result.summary:
            say(f"{result.stage}: {line}")
        summary[result.stage] = result.as_dict()
    return summary


def _quantize(opts: BuildOptions, build_dir: Path, source: ValidatedCheckpoint) -> StageResult:
    from quantize.run import QuantizeOptions
    from quantize.stage import quantize_stage

    return quantize_stage(
        QuantizeOptions(
            model=opts.model,
            precision=opts.precision,
            output=build_dir / LAYOUT["checkpoint"],
            calib_data=opts.calib_data,
            calib_size=opts.calib_size,
        ),
        build_dir,
        source=source,
    )


def _export(opts: BuildOptions, build_dir: Path) -> StageResult:
    from pipeline.onnx.stage import run_export

    return run_export(build_dir / LAYOUT["checkpoint"], None, build_dir, True)


def _engines(opts: BuildOptions, build_dir: Path) -> StageResult:
    from pipeline.builddir import load_manifest
    from pipeline.engine.stage import engine_stage

    return engine_stage(build_dir, load_manifest(build_dir), opts.limits)


def _package(opts: BuildOptions, build_dir: Path) -> StageResult:
    from pipeline.serving.repository import package_stage

    return package_stage(build_dir, opts.limits.model_dump())
