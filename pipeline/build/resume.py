"""Resuming a build: a finished stage whose inputs and options are unchanged is not run again.

Each stage's fingerprint is a hash of what decides its output: the options it runs with, dgpipe's version
and the fingerprint of the stage before it (so a re-quantized checkpoint re-runs every later stage). The
build records it in the stage's StageRecord when the stage finishes; a later `dgpipe build` in the same
build dir compares and skips the stage when it matches and the stage's outputs are still on disk as it left
them (`STAMPED`: a checkpoint or graph another command wrote over since re-runs its stage). An
interrupted build (Ctrl-C, a failure) therefore resumes from the first stage that did not finish: stage
outputs are written atomically, so a stage either finished and was recorded or left nothing behind.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.builddir import HASH_CACHE_SUFFIX, BuildManifest, StageRecord, load_manifest, read_blocks, save_manifest

# outputs that only their stage writes, stamped (every file's path, size and mtime) when it finishes; the
# engine stage's plugins and the repository are not: the node's engine build writes into the repository
STAMPED = ("checkpoint", "onnx")


def output_stamp(path: Path) -> str:
    """A stat stamp of an output (no content read: the 26B's checkpoint is tens of GB): sha256 of each
    file's relative path, size and mtime. What later stages leave beside an output is left out: hidden
    files (the engine stage's lowered graph, `.trt.*.onnx`, while TensorRT reads it) and hash caches."""
    if path.is_dir():
        files = {f.relative_to(path).as_posix(): f for f in path.rglob("*") if f.is_file() and not _beside(f.name)}
    else:
        files = {path.name: path}
    stats = [(name, f.stat().st_size, f.stat().st_mtime_ns) for name, f in sorted(files.items())]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def _beside(name: str) -> bool:
    return name.startswith(".") or name.endswith(HASH_CACHE_SUFFIX)


def fingerprint(stage: str, inputs: dict[str, Any], previous: str | None) -> str:
    """sha256 of the stage's name, its inputs/options (JSON, sorted keys), dgpipe's version and the
    previous stage's fingerprint."""
    doc = {"stage": stage, "inputs": inputs, "previous": previous, "dgpipe": __version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def file_digest(path: Path | None) -> str | None:
    """Content hash of an input file (calibration data), so an edited file re-runs its stage."""
    if path is None:
        return None
    h = hashlib.sha256()
    for block in read_blocks(Path(path)):
        h.update(block)
    return h.hexdigest()


def finished(
    manifest: BuildManifest, build_dir: Path, stage: str, fp: str, output: str
) -> StageRecord | None:
    """The stage's record when it can be skipped: recorded with this fingerprint and its main `output`
    still on disk (a deferred engine stage has no engines dir, so only the main output is asked for), as
    the stage left it where it is `STAMPED`."""
    rec = manifest.stages.get(stage)
    if rec is None or rec.fingerprint != fp or output not in rec.outputs:
        return None
    path = build_dir / rec.outputs[output]
    if not path.exists():
        return None
    stamp = rec.details.get("output_stamp")
    return rec if stamp is None or stamp == output_stamp(path) else None


def mark(build_dir: Path, stage: str, fp: str, seconds: float, output: str) -> BuildManifest:
    """Record the fingerprint of a stage that just finished (and recorded itself) in the build manifest,
    with the time the build measured for it (what a skipped stage reports later) and, for a `STAMPED`
    main `output`, its stamp."""
    man = load_manifest(build_dir)
    rec = man.stages[stage]
    rec.fingerprint = fp
    rec.details["build_seconds"] = seconds
    if output in STAMPED and output in rec.outputs:
        rec.details["output_stamp"] = output_stamp(build_dir / rec.outputs[output])
    save_manifest(build_dir, man)
    return man
