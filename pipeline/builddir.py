"""The build directory: its layout and the build manifest (the limits every stage shares: pipeline.limits).

* Layout: where each artifact lives in a build directory, and inside the Triton model repository (model
  name, version dir, `engines/<target>`), written once here and used by every stage, the Triton model
  and the Kubernetes rendering.
* The build manifest: one JSON file that records what each stage did. Every stage (quantize, export,
  engine, package, manifests) reads its inputs from disk and records itself through `record_stage`, so a
  stage can run alone (`dgpipe export`, `dgpipe manifests`, ...) or inside `dgpipe build`, and a later
  stage learns the precision, GPU targets and artifact paths without being told again. Paths are stored
  relative to the build directory, so a build directory can be moved or copied to a PVC.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePath
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from pipeline import __version__
from pipeline.atomic import atomic_write_text, make_dir
from pipeline.endpoints import MODEL_NAME as MODEL_NAME  # the layout's model dir
from pipeline.errors import DgpipeError, validation_error

MANIFEST_NAME = "build_manifest.json"
LOCK_NAME = ".dgpipe.lock"  # locked by the one command writing the build dir (build_lock)
# a content hash cached beside a large file (the 26B's ONNX weights), keyed by its size and mtime
HASH_CACHE_SUFFIX = ".sha256.json"
SCHEMA_VERSION = 1

# ---- layout -----------------------------------------------------------------------------------------
ENGINES_DIR = "engines"  # <root>/engines/<target>/{model.plan, engine.json}: a build dir and a model version
MODEL_VERSION = "1"  # its one version dir: model.py, checkpoint/, engines/<target>/
TRITON_MODEL_FILE = "model.py"  # the Triton Python-backend model inside the version dir
MODEL_CHECKPOINT = "checkpoint"  # the checkpoint inside the version dir (config parameter `checkpoint`)

# Where each artifact lives inside a build directory (the layout `dgpipe build` writes).
LAYOUT = {
    "checkpoint": "checkpoint",  # HF-layout checkpoint, quantized when precision != bf16
    "onnx": "onnx",  # onnx/model.onnx (+ external data)
    "plugins": "plugins",  # plugins/<arch>/dg_sampler.ptx for the TensorRT plugin
    "engines": ENGINES_DIR,  # engines/<arch>/model.plan + engine.json (built on the target node)
    "model_repository": "model_repository",  # Triton model repository
    "k8s": "k8s",  # rendered Kubernetes manifests
}

P = TypeVar("P", bound=PurePath)  # a local Path, or a PurePosixPath inside a pod
R = TypeVar("R")


def model_version_dir(repository: P, name: str = MODEL_NAME) -> P:
    """The served model's version dir in a Triton repository, where the Triton model looks for its engines."""
    return repository / name / MODEL_VERSION


def target_engine_dir(root: P, target: str) -> P:
    """Where the plan of one GPU target lives under `root` (a build dir, an output dir or a version dir)."""
    return root / ENGINES_DIR / target


def target_plugin_dir(plugins: P, target: str) -> P:
    """The sampler PTX of one GPU target under a plugins dir."""
    return plugins / target


# ---- build manifest ---------------------------------------------------------------------------------
class StageRecord(BaseModel):
    """What one stage did: artifact paths it read and wrote (relative to the build dir when inside it) and
    stage-specific details (its parameters and results)."""

    finished_at: str
    outputs: dict[str, str] = Field(default_factory=dict)
    inputs: dict[str, str] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
    # hash of what the stage read and the options it ran with (pipeline.build.resume): `dgpipe build`
    # skips a finished stage whose fingerprint still matches; None where a stage ran on its own
    fingerprint: str | None = None


class BuildManifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    dgpipe_version: str = __version__
    model: str  # source checkpoint (path or name) the build started from
    model_sha256: str | None = None  # content hash of the source checkpoint's weights
    precision: str
    targets: list[str]  # GPU targets, e.g. ["sm90"] or ["sm100", "sm120"] (configs/targets)
    stages: dict[str, StageRecord] = Field(default_factory=dict)
    # the deploy smoke test for this model (pipeline.deploy.smoke.SmokeTest as a dict): set by `dgpipe build`
    smoke: dict[str, Any] | None = None
    # the served model's name (`dgpipe build --name`): its directory in the repository, the name clients
    # send, and what the pods are told (`dgpipe manifests`); checked where it is set
    model_name: str = MODEL_NAME

    def path_of(self, build_dir: Path, artifact: str) -> Path:
        """Absolute path of an artifact: what a stage recorded, else the default layout."""
        for stage in self.stages.values():
            if artifact in stage.outputs:
                return build_dir / stage.outputs[artifact]
        return build_dir / LAYOUT[artifact]

    def record(self, stage: str, outputs: dict[str, str] | None = None, **details: Any) -> None:
        """Replace the stage's record in memory, paths as given (stages call `record_stage`, which also
        makes paths relative, records inputs and saves)."""
        self.stages[stage] = StageRecord(finished_at=_now(), outputs=outputs or {}, details=details)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def relative_to_build(build_dir: Path, path: str | PurePath) -> str:
    """How a manifest stores a path: relative to the build dir when inside it (a relative path is taken as
    relative to the build dir already), else absolute."""
    root = Path(build_dir).resolve()
    p = Path(path)
    p = (p if p.is_absolute() else root / p).resolve()
    return p.relative_to(root).as_posix() if p.is_relative_to(root) else str(p)


def record_stage(
    build_dir: str | Path,
    stage: str,
    outputs: dict[str, str | PurePath],
    *,
    inputs: dict[str, str | PurePath] | None = None,
    details: dict[str, Any] | None = None,
    manifest: BuildManifest | None = None,
    create: dict[str, Any] | None = None,
) -> BuildManifest:
    """How every stage records itself: the artifacts it wrote (`outputs`) and read (`inputs`), relative to
    the build dir when inside it; its parameters and results (`details`); the time it finished. Saved
    atomically. The manifest is `manifest` when the caller holds it, else the one on disk, created from
    `create` (model, precision, targets) when the stage is the first to run in a new build dir."""
    build_dir = Path(build_dir)
    if manifest is None:
        manifest = load_or_create(build_dir, **create) if create is not None else load_manifest(build_dir)
    manifest.stages[stage] = StageRecord(
        finished_at=_now(),
        outputs={k: relative_to_build(build_dir, v) for k, v in outputs.items()},
        inputs={k: relative_to_build(build_dir, v) for k, v in (inputs or {}).items()},
        details=details or {},
    )
    save_manifest(build_dir, manifest)
    return manifest


def load_manifest(build_dir: str | Path) -> BuildManifest:
    f = Path(build_dir) / MANIFEST_NAME
    if not f.is_file():
        raise DgpipeError(
            f"{f}: no build manifest", "run `dgpipe build` (or the stage that creates it) first"
        )
    with validation_error(lambda where, msg: f"{f}: invalid build manifest ({where}: {msg})"):
        return BuildManifest.model_validate_json(f.read_text())


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


def read_blocks(p: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    with open(p, "rb") as fh:
        while block := fh.read(chunk):
            yield block


def hash_files(paths: list[Path], blocks: Callable[[Path], Iterable[bytes | bytearray]] = read_blocks) -> str:
    """sha256 over (name, content) of files in sorted order: identifies weights, plugins and plans.
    `blocks(path)` yields a file's bytes (a reader that also checks what it reads, so one pass does both)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode() + b"\0")
        for block in blocks(p):
            h.update(block)
    return h.hexdigest()


def checkpoint_hash(
    ckpt_dir: Path, blocks: Callable[[Path], Iterable[bytes | bytearray]] = read_blocks
) -> str:
    """The content hash a build manifest records for its source checkpoint (weights and config.json)."""
    return hash_files([*ckpt_dir.glob("*.safetensors"), *ckpt_dir.glob("config.json")], blocks)


_HELD: set[Path] = set()  # the build dirs this process holds (`build_lock`)


@contextlib.contextmanager
def build_lock(build_dir: str | Path, create: bool = False) -> Iterator[None]:
    """Hold the build dir for one writer: a second dgpipe command writing it (`dgpipe build`, or a stage
    with --build-dir) is refused at once instead of interleaving stages, each of which would record its own
    options over the other's artifacts. An flock, so a killed holder releases it with its process; taken
    again by its holder (a build running its stages), it is already held. A build dir that does not exist
    is made only where the command makes it (`create`: a build); otherwise the stage's own check says it is
    missing, and a mistyped --build-dir leaves nothing behind."""
    import fcntl

    build_dir = Path(build_dir).resolve()
    if build_dir in _HELD or not (create or build_dir.is_dir()):
        yield
        return
    make_dir(build_dir)
    try:
        fh = open(build_dir / LOCK_NAME, "a")  # noqa: SIM115  (closed below, which releases the lock)
    except OSError:  # a build dir this process cannot write: the stage's own first write says so
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise DgpipeError(
                f"{build_dir}: another dgpipe command is writing this build dir",
                "wait for it to finish, or pass another --build-dir",
            ) from e
        except OSError:  # a file system without locks (NFS without its lock service): held by no one
            pass
        _HELD.add(build_dir)
        try:
            yield
        finally:
            _HELD.discard(build_dir)


def holding_build_dir(stage: Callable[..., R]) -> Callable[..., R]:
    """A stage function that holds its `build_dir` argument (`build_lock`) while it runs, where one is
    given: the same stage runs alone (`dgpipe export --build-dir`) or inside `dgpipe build`."""
    import functools
    import inspect

    signature = inspect.signature(stage)

    @functools.wraps(stage)
    def run(*args: Any, **kwargs: Any) -> R:
        build_dir = signature.bind(*args, **kwargs).arguments.get("build_dir")
        if build_dir is None:
            return stage(*args, **kwargs)
        with build_lock(build_dir):
            return stage(*args, **kwargs)

    return run
