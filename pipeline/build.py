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
from pathlib import Path

from pipeline.builddir import (
    LAYOUT,
    EngineLimits,
    checkpoint_hash,
    load_or_create,
    save_manifest,
)
from pipeline.errors import DgpipeError
from pipeline.stages import StageResult

DEFAULT_TARGETS = ("sm90", "sm100", "sm120")  # the architectures the engines and kernels are built for


@dataclass
class BuildOptions:
    model: Path
    precision: str
    build_dir: Path
    targets: list[str] = field(default_factory=list)  # empty: every default target that runs `precision`
    calib_size: int = 64
    calib_data: Path | None = None
    max_batch: int = EngineLimits.max_batch
    max_prompt: int = EngineLimits.max_prompt
    max_context: int = EngineLimits.max_context

    @property
    def limits(self) -> EngineLimits:
        """The engine is built for these; the repository admits prompts and max_tokens that fit them."""
        return EngineLimits(
            self.max_batch,
            self.max_prompt,
            self.max_context,
            max_tokens=self.max_context - self.max_prompt,
        )


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

    if opts.max_context < opts.max_prompt + 1 or min(opts.max_batch, opts.max_prompt) < 1:
        raise DgpipeError("--max-batch and --max-prompt must be >= 1 and --max-context > --max-prompt")
    targets = resolve_targets(opts.precision, opts.targets)
    # a missing, broken or hostile checkpoint fails before any stage runs or anything is written
    ckpt = validate_checkpoint(opts.model, weights=True)
    build_dir = opts.build_dir.resolve()
    man = load_or_create(
        build_dir,
        model=str(opts.model),
        precision=opts.precision,
        targets=targets,
        model_sha256=checkpoint_hash(opts.model),
    )
    man.smoke = smoke_test_for(ckpt).as_dict()  # what `dgpipe manifests` renders into the smoke Job
    save_manifest(build_dir, man)
    say(f"build {build_dir}: {opts.model} -> {opts.precision} for {', '.join(targets)}")
    summary: dict[str, object] = {
        "build_dir": str(build_dir),
        "precision": opts.precision,
        "targets": targets,
    }
    for stage in (_quantize, _export, _engines, _package):  # each reads what the one before wrote
        result = stage(opts, build_dir)
        for line in result.summary:
            say(f"{result.stage}: {line}")
        summary[result.stage] = result.as_dict()
    return summary


def _quantize(opts: BuildOptions, build_dir: Path) -> StageResult:
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

    return package_stage(build_dir, opts.limits)
