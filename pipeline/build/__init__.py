"""`dgpipe build`: checkpoint -> quantized checkpoint -> ONNX -> sampler PTX + engines -> Triton repository.

The build tells its caller what it does through typed events (pipeline.build.events: each stage starts,
reports progress with an ETA, finishes or is skipped) and never prints; a re-run skips every finished stage
whose inputs are unchanged (pipeline.build.resume) and ends with a summary (pipeline.build.summary).

Each stage is the same code its own command runs (`dgpipe quantize`, `export`, `engine build`, `package`),
reading the previous stage's output from the build directory and recording itself in the build manifest,
so a failed build resumes from the stage that failed with the same commands a user would type. Engines
are built here only where TensorRT and a GPU of the target exist; otherwise the build records the exact
`dgpipe engine build` command that the serving image runs on the target node (the Kubernetes
initContainer rendered by `dgpipe manifests`) and says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.build import resume
from pipeline.build.events import (
    BuildFinished,
    BuildStarted,
    Emit,
    PhaseProgress,
    StageFinished,
    StageSkipped,
    StageStarted,
)
from pipeline.build.summary import Row, engines, next_command, tree_size
from pipeline.builddir import (
    LAYOUT,
    build_lock,
    load_or_create,
    save_manifest,
)
from pipeline.endpoints import MODEL_NAME, check_model_name
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
    name: str = MODEL_NAME  # the served model's name (BuildManifest.model_name)
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


STAGES = ("quantize", "export", "engine", "package")
MAIN_OUTPUT = {"quantize": "checkpoint", "export": "onnx", "engine": "plugins", "package": "model_repository"}


def run_build(opts: BuildOptions, emit: Emit) -> dict:
    """Every stage in order on one build dir, telling `emit` as each starts, progresses and finishes (or is
    skipped: its recorded fingerprint matches, pipeline.build.resume). Returns the build's summary: its
    dir, precision, targets and each stage's figures by stage name (also in the BuildFinished event)."""
    started = time.monotonic()
    emit(StageStarted("validate", f"checking {opts.model}: config, tensors, finite weights"))
    from pipeline.model.validate import validate_checkpoint
    from quantize.run import check_options

    if opts.limits.max_context <= opts.limits.max_prompt:
        raise DgpipeError("--max-context must be > --max-prompt")
    check_model_name(opts.name)
    check_options(_quantize_options(opts, opts.build_dir.resolve()))  # --calib-data etc., before any write
    targets = resolve_targets(opts.precision, opts.targets)
    # a missing, broken or hostile checkpoint fails before any stage runs or anything is written; the
    # one pass over its weights also gives the content hash, and the quantize stage takes this value
    source = validate_checkpoint(opts.model, weights=True, limits=opts.limits)
    opts.limits.validate(source.config.canvas_length)  # the engines and the repository, before any stage
    opts.limits.check_fits(source.config.canvas_length)
    build_dir = opts.build_dir.resolve()
    with build_lock(build_dir, create=True):  # one writer: a second build into it is refused, not interleaved
        return _run_stages(opts, emit, source, targets, build_dir, started)


def _run_stages(
    opts: BuildOptions,
    emit: Emit,
    source: ValidatedCheckpoint,
    targets: list[str],
    build_dir: Path,
    started: float,
) -> dict:
    """`run_build` past its checks, the build dir held: the manifest, then each stage run or skipped."""
    from pipeline.deploy.smoke import smoke_test_for

    man = load_or_create(
        build_dir,
        model=str(opts.model),
        precision=opts.precision,
        targets=targets,
        model_sha256=source.sha256,
    )
    man.model, man.model_sha256, man.model_name = str(opts.model), source.sha256, opts.name
    man.smoke = smoke_test_for(source).as_dict()  # what `dgpipe manifests` renders into the smoke Job
    save_manifest(build_dir, man)
    validated = time.monotonic() - started
    emit(
        StageFinished(
            "validate", round(validated, 2), str(opts.model), tree_size(opts.model), "checkpoint valid"
        )
    )
    emit(BuildStarted(str(build_dir), str(opts.model), opts.precision, targets))
    summary: dict[str, object] = {
        "build_dir": str(build_dir),
        "precision": opts.precision,
        "targets": targets,
    }
    rows = [Row("validate", "ran", round(validated, 2), str(opts.model), tree_size(opts.model), "valid")]
    runners = {
        "quantize": partial(_quantize, source=source),
        "export": _export,
        "engine": _engines,
        "package": _package,
    }
    previous: str | None = None
    for stage in STAGES:  # each reads what the one before wrote
        fp = resume.fingerprint(stage, _stage_inputs(stage, opts, source, targets), previous)
        previous = fp
        rec = resume.finished(man, build_dir, stage, fp, MAIN_OUTPUT[stage])
        if rec is not None:
            out = build_dir / rec.outputs[MAIN_OUTPUT[stage]]
            seconds = float(rec.details.get("build_seconds", 0.0))
            emit(StageSkipped(stage, f"unchanged since {rec.finished_at}", str(out), tree_size(out), seconds))
            rows.append(
                Row(
                    stage,
                    "skipped",
                    seconds,
                    _rel(out, build_dir),
                    tree_size(out),
                    _gate(stage, opts, rec.details),
                )
            )
            summary[stage] = {"stage": stage, "skipped": True, **rec.details}
            continue
        emit(StageStarted(stage, _what(stage, opts, targets)))
        t0 = time.monotonic()
        result = runners[stage](opts, build_dir, emit=emit)
        seconds = round(time.monotonic() - t0, 2)
        man = resume.mark(build_dir, stage, fp, seconds, MAIN_OUTPUT[stage])
        out = result.paths.get(MAIN_OUTPUT[stage], build_dir / LAYOUT[MAIN_OUTPUT[stage]])
        gate = _gate(stage, opts, result.details)
        emit(
            StageFinished(
                stage, seconds, str(out), tree_size(Path(out)), gate, result.summary, result.as_dict()
            )
        )
        rows.append(Row(stage, "ran", seconds, _rel(Path(out), build_dir), tree_size(Path(out)), gate))
        summary[stage] = result.as_dict()
    engine_status = engines(man, build_dir)
    emit(
        BuildFinished(
            round(time.monotonic() - started, 2),
            [r.as_dict() for r in rows],
            engine_status,
            next_command(build_dir, engine_status),
            summary,
        )
    )
    return summary


def _stage_inputs(stage: str, opts: BuildOptions, source: ValidatedCheckpoint, targets: list[str]) -> dict:
    """What decides a stage's output besides the stage before it (the fingerprint's inputs)."""
    if stage == "quantize":
        return {
            "model_sha256": source.sha256,
            "precision": opts.precision,
            "calib_size": opts.calib_size,
            "calib_data": resume.file_digest(opts.calib_data),
        }
    # a name other than the default is an input of the engine stage (the node's command writes into the
    # named model's version dir) and of the package stage; the default adds nothing, so builds made before
    # the name was an option keep their fingerprints
    named = {"name": opts.name} if opts.name != MODEL_NAME else {}
    if stage == "engine":
        return {"targets": targets, "limits": opts.limits.engine_values(), **named}
    if stage == "package":
        return {"limits": opts.limits.model_dump(), **named}
    return {}


def _what(stage: str, opts: BuildOptions, targets: list[str]) -> str:
    return {
        "quantize": f"{opts.precision} with ModelOpt, calibrated on {opts.calib_size} prompts",
        "export": "ONNX graph with the sampler ops",
        "engine": f"sampler PTX and TensorRT engines for {', '.join(targets)}",
        "package": "Triton model repository",
    }[stage]


def _gate(stage: str, opts: BuildOptions, details: dict) -> str:
    """The stage's gate as the summary shows it. The build runs the validity gates (checkpoint checks,
    onnx.checker, engine profiles); the accuracy gate is its own command, named here."""
    if stage == "quantize":
        if opts.precision == "bf16":
            return "reference (not quantized)"
        return f"accuracy: run `dgpipe eval quantization --precisions {opts.precision}`"
    if stage == "export":
        return "onnx.checker passed"
    if stage == "engine":
        status = [e.get("status", "?") for e in details.get("engines", {}).values()]
        return ", ".join(f"{status.count(s)} {s}" for s in dict.fromkeys(status)) or "no targets"
    return "-"


def _rel(path: Path, build_dir: Path) -> str:
    path = Path(path)
    return path.relative_to(build_dir).as_posix() if path.is_relative_to(build_dir) else str(path)


def _phases(emit: Emit | None, stage: str):
    """A `phases(name, total)` factory for a stage: each phase is a PhaseProgress on `emit`."""

    def phase(name: str, total: int | None):
        if emit is None:
            return lambda k=1: None
        return PhaseProgress(emit, stage, name, total).advance

    return phase


def _steps(emit: Emit | None, stage: str, total: int | None):
    """A `step(name)` callback for a stage whose steps are named as they start (export, engine)."""
    if emit is None:
        return None
    prog: list[PhaseProgress] = []

    def step(name: str) -> None:  # done counts the steps before this one
        if prog:
            prog[0].advance(1, phase=name)
        else:
            prog.append(PhaseProgress(emit, stage, name, total))

    return step


def _bytes_copied(emit: Emit | None, stage: str, phase: str):
    """A `progress(done, total)` callback in bytes, shown as a phase counted in MiB (an event per MiB
    gained, not per call: the streaming export calls it per chunk copied)."""
    if emit is None:
        return lambda done, total: None
    bar: list[PhaseProgress] = []

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(PhaseProgress(emit, stage, phase, max(total >> 20, 1)))
        mib = bar[0].total if done >= total else done >> 20
        if mib > bar[0].done:
            bar[0].advance(mib - bar[0].done)

    return progress


# What the quantize stage imports before its first phase: each takes seconds on a busy CPU and holds the
# interpreter meanwhile (the console's bar cannot redraw), so each is announced as a step of its own.
HEAVY_IMPORTS = ("torch", "transformers", "modelopt.torch.quantization")


def _quantize(
    opts: BuildOptions, build_dir: Path, source: ValidatedCheckpoint, emit: Emit | None = None
) -> StageResult:
    import importlib

    step = _steps(emit, "quantize", len(HEAVY_IMPORTS))
    for name in HEAVY_IMPORTS:
        if step is not None:
            step(f"import {name.split('.')[0]}")
        importlib.import_module(name)
    from quantize.stage import quantize_stage

    return quantize_stage(
        _quantize_options(opts, build_dir), build_dir, source=source, phases=_phases(emit, "quantize")
    )


def _quantize_options(opts: BuildOptions, build_dir: Path):
    from quantize.run import QuantizeOptions

    return QuantizeOptions(
        model=opts.model,
        precision=opts.precision,
        output=build_dir / LAYOUT["checkpoint"],
        calib_data=opts.calib_data,
        calib_size=opts.calib_size,
    )


def _export(opts: BuildOptions, build_dir: Path, emit: Emit | None = None) -> StageResult:
    from pipeline.engine.build_engine import GRAPH_DTYPE
    from pipeline.onnx.stage import run_export

    # the checkpoint is streamed into the graph, not loaded (float or FP8 / NVFP4: the 26B's export holds the
    # traced graph and one chunk of host memory), in the model dtype TensorRT runs (onnxruntime cannot run it
    # on CPU; `dgpipe export --dtype float32` writes the reference graph)
    return run_export(
        build_dir / LAYOUT["checkpoint"],
        None,
        build_dir,
        True,
        stream=True,
        step=_steps(emit, "export", 1),
        dtype=GRAPH_DTYPE,
        progress=_bytes_copied(emit, "export", "copy weights (MiB)"),
    )


def _engines(opts: BuildOptions, build_dir: Path, emit: Emit | None = None) -> StageResult:
    from pipeline.builddir import load_manifest
    from pipeline.engine.stage import engine_stage

    man = load_manifest(build_dir)
    return engine_stage(build_dir, man, opts.limits, step=_steps(emit, "engine", len(man.targets)))


def _package(opts: BuildOptions, build_dir: Path, emit: Emit | None = None) -> StageResult:
    from pipeline.serving.repository import package_stage

    return package_stage(build_dir, opts.limits.model_dump())
