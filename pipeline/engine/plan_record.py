"""`engine.json`, the manifest beside each `engines/<target>/model.plan`, and the rules that read it.

A TensorRT plan only runs on the TensorRT version that built it and on GPUs of the compute capability it
was built on, and ours also embeds the sampler PTX: so the manifest records exactly those (plus precision,
checkpoint/ONNX hashes, build flags, the engine caps as data and profiles), `check_compatible` refuses a plan that does not match the
running TensorRT and GPU with a message naming the mismatch and the fix, and `is_current` tells the
on-node build step whether an existing plan can be kept (same inputs, same TensorRT, same GPU).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from pipeline import __version__
from pipeline.atomic import atomic_write_text
from pipeline.errors import DgpipeError, validation_error

PLAN_NAME = "model.plan"
ENGINE_MANIFEST = "engine.json"
SCHEMA_VERSION = 1


class PluginRecord(BaseModel):
    name: str = "dgpipe::SampleRows+SampleAccept (AOT Python plugins, PTX embedded in the plan)"
    arch: str  # PTX .target, e.g. sm_90a
    ptx_sha256: str
    entry_points: list[str] = Field(default_factory=list)


class ProfileRecord(BaseModel):
    """One optimization profile: input name -> [min, opt, max] shapes; shape-tensor input values too."""

    name: str
    shapes: dict[str, list[list[int]]]
    shape_values: dict[str, list[list[int]]] = Field(default_factory=dict)


class EngineManifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    dgpipe_version: str = __version__
    plan: str = PLAN_NAME
    plan_sha256: str
    tensorrt_version: str  # tensorrt.__version__ of the builder, e.g. "10.13.2.6"
    target: str  # configs/targets name, e.g. sm90
    arch: str  # e.g. sm_90a
    compute_capability: str  # e.g. "9.0", of the GPU that built the plan
    gpu_name: str = ""
    precision: str
    plugin: PluginRecord
    onnx_sha256: str
    checkpoint_sha256: str | None = None
    build_flags: dict[str, Any] = Field(default_factory=dict)
    limits: dict[str, int] = Field(default_factory=dict)  # the engine caps it was built for (pipeline.limits)
    profiles: list[ProfileRecord] = Field(default_factory=list)
    built_at: str = Field(
        default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    )


def load_engine_manifest(engine_dir: Path | str) -> EngineManifest:
    f = Path(engine_dir) / ENGINE_MANIFEST
    if not f.is_file():
        raise DgpipeError(f"{f}: no engine manifest", hint="build the engine with `dgpipe engine build`")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DgpipeError(f"{f}: invalid engine manifest ({str(e).splitlines()[0]})") from e
    with validation_error(lambda where, msg: f"{f}: invalid engine manifest ({where}: {msg})"):
        return EngineManifest.model_validate(raw)


def save_engine_manifest(engine_dir: Path | str, manifest: EngineManifest) -> Path:
    """Atomic write, like the build manifest: a half-written manifest must never vouch for a plan."""
    return atomic_write_text(Path(engine_dir) / ENGINE_MANIFEST, manifest.model_dump_json(indent=2) + "\n")


def _trt_release(version: str) -> tuple[int, ...]:
    """major.minor.patch of a TensorRT version string ("10.13.2.6" -> (10, 13, 2)); the build number is
    not part of plan compatibility."""
    parts = [int(p) for p in version.split(".")[:3] if p.isdigit()]
    return tuple(parts)


def check_compatible(
    manifest: EngineManifest,
    tensorrt_version: str | None,
    gpu_cc: str | None,
    *,
    ptx_sha256: str | None = None,
    where: str = "the plan",
) -> None:
    """Refuse a plan the running TensorRT / GPU cannot (or should not) run, naming what differs and the fix.

    `ptx_sha256` is the sampler PTX this package would build now: a plan embedding other kernels is stale."""
    rebuild = f"rebuild it on this node: dgpipe engine build --target {manifest.target} --precision {manifest.precision} ..."
    if tensorrt_version is None:
        raise DgpipeError(
            f"{where} needs TensorRT {manifest.tensorrt_version}, and TensorRT is not installed here",
            hint="run it in the serving image (which has TensorRT) or install the same TensorRT version",
        )
    if _trt_release(tensorrt_version) != _trt_release(manifest.tensorrt_version):
        raise DgpipeError(
            f"{where} was built with TensorRT {manifest.tensorrt_version}, this is TensorRT {tensorrt_version}: "
            "a plan only loads on the TensorRT version that built it",
            hint=rebuild,
        )
    if gpu_cc is None:
        raise DgpipeError(
            f"{where} needs a GPU of compute capability {manifest.compute_capability}; none is visible"
        )
    if gpu_cc != manifest.compute_capability:
        raise DgpipeError(
            f"{where} was built for compute capability {manifest.compute_capability} ({manifest.target}), "
            f"this GPU is {gpu_cc}",
            hint=f"use the plan for this GPU's target, or {rebuild}",
        )
    if ptx_sha256 is not None and ptx_sha256 != manifest.plugin.ptx_sha256:
        raise DgpipeError(
            f"{where} embeds sampler PTX {manifest.plugin.ptx_sha256[:12]}, this dgpipe's is {ptx_sha256[:12]}: "
            "the plan was built from other sampler kernels",
            hint=rebuild,
        )


def is_current(
    engine_dir: Path | str,
    *,
    tensorrt_version: str,
    gpu_cc: str,
    precision: str,
    onnx_sha256: str,
    ptx_sha256: str,
    profiles: list[ProfileRecord],
) -> tuple[bool, str]:
    """Whether the plan in `engine_dir` was built from these exact inputs by this TensorRT on this GPU kind.

    The on-node build step (initContainer / Job) calls this first, so a pod restart reuses the plan instead
    of spending minutes rebuilding it. Returns (current, reason)."""
    from pipeline.builddir import hash_files

    d = Path(engine_dir)
    if not (d / PLAN_NAME).is_file():
        return False, f"no plan at {d / PLAN_NAME}"
    try:
        man = load_engine_manifest(d)
        check_compatible(man, tensorrt_version, gpu_cc, ptx_sha256=ptx_sha256)
    except DgpipeError as e:
        return False, str(e)
    if hash_files([d / man.plan]) != man.plan_sha256:
        return False, "the plan's sha256 differs from its manifest (modified or truncated)"
    if man.precision != precision:
        return False, f"the plan is {man.precision}, {precision} was asked for"
    if man.onnx_sha256 != onnx_sha256:
        return False, "the ONNX model changed since the plan was built"
    if [p.model_dump() for p in man.profiles] != [p.model_dump() for p in profiles]:
        return False, "the optimization profiles (batch / prompt / context limits) changed"
    return (
        True,
        f"up to date (TensorRT {man.tensorrt_version}, cc {man.compute_capability}, built {man.built_at})",
    )
