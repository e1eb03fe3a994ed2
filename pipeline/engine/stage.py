"""The engine stage of `dgpipe build`: PTX for every target, then the engine here or a step for the node.

On any machine it compiles the sampler PTX per target into `plugins/<target>/` (nvcc only) and validates
the engine build (precision on target, ONNX inputs -> profiles). Where TensorRT >= 10.9 and a GPU of a
target are present it builds that target's engine; for every other target it records the exact
`dgpipe engine build ...` command that the serving image runs on the target node (a Kubernetes
initContainer or Job, rendered by the manifests stage from the build manifest), and the summary says so.
The engine caps are recorded as data, for the run and per target (`limits`), where package and render
read them back (`recorded_limits`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.builddir import (
    LAYOUT,
    BuildManifest,
    build_lock,
    holding_build_dir,
    load_manifest,
    model_version_dir,
    record_stage,
    relative_to_build,
    target_engine_dir,
    target_plugin_dir,
)
from pipeline.engine.build_engine import NODE_STEP, BuildPlan, build, missing_for_local_build, plan_build
from pipeline.engine.plan_record import EngineManifest
from pipeline.engine.ptx import build_plugin_ptx
from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.stages import StageResult
from pipeline.targets import target as get_target

STAGE = "engine"


@holding_build_dir
def engine_stage(
    build_dir: Path,
    manifest: BuildManifest,
    limits: Limits | None = None,
    step: Callable[[str], None] | None = None,
) -> StageResult:
    """Run the stage for every target in the manifest; records it; its summary has one line per target.
    `step(target)` is told as each target starts (a watched build's progress)."""
    start = time.perf_counter()
    build_dir = Path(build_dir).resolve()
    onnx = manifest.path_of(build_dir, "onnx")
    plugins = build_dir / LAYOUT["plugins"]
    limits = limits or Limits()
    engines: dict[str, dict] = {}
    lines = []
    for name in manifest.targets:
        t = get_target(name)
        if step is not None:
            step(t.name)
        info = build_plugin_ptx(plugins, t.name)
        plan = plan_build(
            onnx,
            t.name,
            manifest.precision,
            build_dir,
            plugins=plugins,
            limits=limits,
            checkpoint_sha256=manifest.model_sha256,
        )
        # on the node the plan goes straight into the served model's version dir, where the Triton model
        # looks for engines/<target> (a local build lands in engines/ and `package` copies it there);
        # paths are relative to the build dir, which the node mounts as its workdir
        version_dir = model_version_dir(build_dir / LAYOUT["model_repository"], manifest.model_name)
        node_plan = dataclasses.replace(plan, engine_dir=target_engine_dir(version_dir, t.name))
        command = _relative_command(node_plan.command(), build_dir)
        missing = missing_for_local_build(t)
        record = {
            "ptx": relative_to_build(build_dir, target_plugin_dir(plugins, t.name) / info.file),
            "ptx_sha256": info.sha256,
            "command": command,
            "limits": limits.engine_values(),
        }
        if missing:
            record |= {"status": "deferred", "reason": "; ".join(missing)}
            lines.append(
                f"engine {t.name}: not built here ({'; '.join(missing)}); "
                + NODE_STEP.format(command=" ".join(command))
            )
        else:
            em, built = build(plan)
            record |= {"status": "built" if built else "up to date", "tensorrt": em.tensorrt_version}
            lines.append(
                f"engine {t.name}: {record['status']} at {plan.engine_dir}/{em.plan} (TensorRT {em.tensorrt_version})"
            )
        engines[t.name] = record
    record_stage(
        build_dir,
        STAGE,
        {"plugins": plugins, "engines": LAYOUT["engines"]},
        inputs={"onnx": onnx},
        details={"engines": engines, "limits": limits.engine_values()},
        manifest=manifest,
    )
    paths = {"plugins": plugins, "engines": build_dir / LAYOUT["engines"]}
    details = {"engines": engines, "limits": limits.engine_values()}
    return StageResult(STAGE, paths, time.perf_counter() - start, lines, details)


@dataclass(frozen=True)
class EngineBuild:
    """`dgpipe engine build`: one target's engine from an ONNX export, or from a build dir's."""

    target: str
    onnx: Path | None = None  # default: the build dir's
    precision: str | None = None  # default: the target's
    output: Path | None = None  # writes <output>/engines/<target>/; default: the build dir
    plugins: Path | None = None  # dir holding <target>/dg_sampler.ptx; default: the build dir's
    build_dir: Path | None = None  # a `dgpipe build` directory: defaults + manifest record
    limits: Limits = dataclasses.field(default_factory=Limits)
    force: bool = False  # rebuild even when the plan is up to date
    dry_run: bool = False  # validate and describe the build (and its node command) only


def build_one_engine(req: EngineBuild) -> StageResult:
    """Plan the engine (refusing bad input before any work), then build it unless `dry_run`; with a build
    dir the plan is added to its engine stage record."""
    start = time.perf_counter()
    t = get_target(req.target)  # unknown target: refused before anything else
    precision = req.precision or t.default_precision
    man = load_manifest(req.build_dir) if req.build_dir is not None else None
    onnx, plugins = req.onnx, req.plugins
    if man is not None:
        onnx = onnx or man.path_of(req.build_dir, "onnx")
        plugins = plugins or man.path_of(req.build_dir, "plugins")
    if onnx is None:
        raise DgpipeError("--onnx is required (or --build-dir of a `dgpipe build`)")
    output = req.output or req.build_dir
    if output is None:
        raise DgpipeError("--output is required (or --build-dir)")
    plan = plan_build(
        onnx,
        t.name,
        precision,
        output,
        plugins=plugins,
        limits=req.limits,
        checkpoint_sha256=man.model_sha256 if man else None,
    )
    summary = {
        "target": t.name,
        "precision": precision,
        "engine_dir": str(plan.engine_dir),
        "profiles": [p.model_dump() for p in plan.profiles],
        "node_command": plan.command(),
    }
    if req.dry_run:
        return StageResult(STAGE, {}, time.perf_counter() - start, describe_plan(plan), summary)
    with build_lock(req.build_dir) if req.build_dir is not None else contextlib.nullcontext():
        manifest, built = build(plan, force=req.force)
        if man is not None and req.build_dir is not None:
            record_built_engine(req.build_dir, manifest, output)
    summary |= {
        "built": built,
        "tensorrt_version": manifest.tensorrt_version,
        "plan_sha256": manifest.plan_sha256,
    }
    verb = "built" if built else "up to date, kept"
    line = (
        f"{plan.engine_dir / manifest.plan}: {verb} (TensorRT {manifest.tensorrt_version}, "
        f"{manifest.gpu_name}, cc {manifest.compute_capability}, {manifest.precision})"
    )
    paths = {"engine": plan.engine_dir / manifest.plan}
    return StageResult(STAGE, paths, time.perf_counter() - start, [line], summary)


def describe_plan(plan: BuildPlan) -> list[str]:
    """What an engine build would do: target, precision, sampler PTX, profiles, the node's command."""
    lines = [
        f"engine build for {plan.target.name} ({plan.target.arch}, cc {plan.target.compute_capability}), "
        f"precision {plan.precision}: {plan.engine_dir}/model.plan"
    ]
    ptx = plan.plugin.sha256[:16] if plan.plugin else "compiled at build time"
    lines.append(f"  sampler PTX: {plan.plugin_dir}/dg_sampler.ptx ({ptx})")
    for p in plan.profiles:
        dims = {k: v for k, v in p.shapes.items() if k in ("tokens", "sc_embed")}
        lines.append(f"  profile {p.name}: " + ", ".join(f"{k} {v[0]}..{v[2]}" for k, v in dims.items()))
    lines.append("  on the target node: " + " ".join(plan.command()))
    return lines


def record_built_engine(build_dir: Path, engine: EngineManifest, output: Path) -> None:
    """`dgpipe engine build --build-dir`: add one target's plan (built under `output`) to the engine stage's
    record, keeping what the stage recorded for the other targets."""
    man = load_manifest(build_dir)
    previous = man.stages.get(STAGE)
    engines = dict(previous.details.get("engines", {})) if previous else {}
    engines[engine.target] = {
        "status": "built",
        "tensorrt": engine.tensorrt_version,
        "cc": engine.compute_capability,
        "limits": Limits.from_record(engine.limits, f"engine.json of {engine.target}").engine_values(),
    }
    outputs = dict(previous.outputs) if previous else {}
    record_stage(
        build_dir,
        STAGE,
        {**outputs, "engines": Path(output).resolve() / LAYOUT["engines"]},
        inputs=dict(previous.inputs) if previous else {},
        details={**(previous.details if previous else {}), "engines": engines},
        manifest=man,
    )


def recorded_limits(manifest: BuildManifest, target: str | None = None) -> Limits:
    """The engine caps the build recorded as data: those of `target`'s plan, else of the engine stage's
    run; the defaults for a build whose engine stage has not run. The package stage's serving caps too,
    so a later `dgpipe package --build-dir` writes what `dgpipe build` wrote."""
    stage = manifest.stages.get(STAGE)
    details = stage.details if stage else {}
    engine = details.get("limits")
    if target is not None:
        engine = details.get("engines", {}).get(target, {}).get("limits", engine)
    package = manifest.stages.get("package")
    serving = package.details.get("limits") if package else None
    where = f"build manifest: {STAGE} limits" + (f" for {target}" if target else "")
    recorded = {**_mapping(serving, where), **_mapping(engine, where)}
    return Limits.from_record(recorded, where)


def _mapping(value: object, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DgpipeError(f"{where}: expected a mapping of limit name -> value, got {value!r}")
    return value


def _relative_command(cmd: list[str], build_dir: Path) -> list[str]:
    out = []
    for arg in cmd:
        p = Path(arg)
        if p.is_absolute() and p.is_relative_to(build_dir):  # outside the build dir: kept absolute
            arg = str(p.relative_to(build_dir))
        out.append(arg)
    return out
