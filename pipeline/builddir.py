"""The build manifest: one JSON file in a build directory that records what each stage did.

Every stage (quantize, export, engine, package, manifests) reads its inputs from disk and records its
outputs here, so a stage can run alone (`dgpipe export`, `dgpipe manifests`, ...) or inside `dgpipe build`,
and a later stage learns the precision, GPU targets and artifact paths without being told again.
Paths are stored relative to the build directory, so a build directory can be moved or copied to a PVC.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from pipeline import __version__
from pipeline.atomic import atomic_write_text
from pipeline.errors import DgpipeError

MANIFEST_NAME = "build_manifest.json"
SCHEMA_VERSION = 1

# Where each artifact lives inside a build directory (the layout `dgpipe build` writes).
LAYOUT = {
    "checkpoint": "checkpoint",  # HF-layout checkpoint, quantized when precision != bf16
    "onnx": "onnx",  # onnx/model.onnx (+ external data)
    "plugins": "plugins",  # plugins/<arch>/dg_sampler.ptx for the TensorRT plugin
    "engines": "engines",  # engines/<arch>/model.plan + engine.json (built on the target node)
    "model_repository": "model_repository",  # Triton model repository
    "k8s": "k8s",  # rendered Kubernetes manifests
}


class StageRecord(BaseModel):
    """What one stage produced: artifact paths (relative to the build dir) and stage-specific details."""

    finished_at: str
    outputs: dict[str, str] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)


class BuildManifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    dgpipe_version: str = __version__
    model: str  # source checkpoint (path or name) the build started from
    model_sha256: str | None = None  # content hash of the source checkpoint's weights
    precision: str
    targets: list[str]  # GPU targets, e.g. ["sm90"] or ["sm100", "sm120"] (configs/targets)
    stages: dict[str, StageRecord] = Field(default_factory=dict)

    def path_of(self, build_dir: Path, artifact: str) -> Path:
        """Absolute path of an artifact: what a stage recorded, else the default layout."""
        for stage in self.stages.values():
            if artifact in stage.outputs:
                return build_dir / stage.outputs[artifact]
        return build_dir / LAYOUT[artifact]

    def record(self, stage: str, outputs: dict[str, str] | None = None, **details: Any) -> None:
        self.stages[stage] = StageRecord(
            finished_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            outputs=outputs or {},
            details=details,
        )


def load_manifest(build_dir: str | Path) -> BuildManifest:
    f = Path(build_dir) / MANIFEST_NAME
    if not f.is_file():
        raise DgpipeError(
            f"{f}: no build manifest", "run `dgpipe build` (or the stage that creates it) first"
        )
    try:
        return BuildManifest.model_validate_json(f.read_text())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DgpipeError(f"{f}: invalid build manifest ({where}: {first['msg']})") from e


def load_or_create(build_dir: str | Path, **fields: Any) -> BuildManifest:
    """The build dir's manifest, created from `fields` when absent; a precision/target change is refused."""
    f = Path(build_dir) / MANIFEST_NAME
    if not f.is_file():
        return BuildManifest(**fields)
    man = load_manifest(build_dir)
    for key in ("precision", "targets"):
        if key in fields and fields[key] != getattr(man, key):
            raise DgpipeError(
                f"{f}: was built for {key}={getattr(man, key)}, not {fields[key]}",
                "use a new --build-dir for a different precision or target",
            )
    return man


def save_manifest(build_dir: str | Path, manifest: BuildManifest) -> Path:
    """Atomic: later stages trust what the manifest says, so it is never half-written."""
    return atomic_write_text(
        Path(build_dir) / MANIFEST_NAME, json.dumps(manifest.model_dump(), indent=2) + "\n"
    )


def hash_files(paths: list[Path], chunk: int = 1 << 20) -> str:
    """sha256 over (name, content) of files in sorted order: identifies weights, plugins and plans."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return h.hexdigest()


def checkpoint_hash(ckpt_dir: Path) -> str:
    return hash_files([*ckpt_dir.glob("*.safetensors"), *ckpt_dir.glob("config.json")])
