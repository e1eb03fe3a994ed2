"""The engine stage of `dgpipe build`: PTX for every target, then the engine here or a step for the node.

On any machine it compiles the sampler PTX per target into `plugins/<target>/` (nvcc only) and validates
the engine build (precision on target, ONNX inputs -> profiles). Where TensorRT >= 10.8 and a GPU of a
target are present it builds that target's engine; for every other target it records the exact
`dgpipe engine build ...` command that the serving image runs on the target node (a Kubernetes
initContainer or Job, rendered by the manifests stage from the build manifest), and the summary says so.
The engine caps are recorded as data, for the run and per target (`limits`), where package and render
read them back (`recorded_limits`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.builddir import (
    LAYOUT,
    BuildManifest,
    load_manifest,
    model_version_dir,
    record_stage,
    relative_to_build,
    target_engine_dir,
    target_plugin_dir,
)
from pipeline.engine.build_engine import NODE_STEP, build, missing_for_local_build, plan_build
from pipeline.engine.plan_record import EngineManifest
from pipeline.engine.ptx import build_plugin_ptx
from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.targets import target as get_target

STAGE = "engine"


def engine_stage(build_dir: Path, manifest: BuildManifest, limits: Limits | None = None) -> list[str]:
    """Run the stage for every target in the manifest; records it and returns one summary line per target."""
    build_dir = Path(build_dir).resolve()
    onnx = manifest.path_of(build_dir, "onnx")
    plugins = build_dir / LAYOUT["plugins"]
    limits = limits or Limits()
    engines: dict[str, dict] = {}
    lines = []
    for name in manifest.targets:
        t = get_target(name)
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
        version_dir = model_version_dir(build_dir / LAYOUT["model_repository"])
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
