"""Resuming a build: a finished stage whose inputs and options are unchanged is not run again.

Each stage's fingerprint is a hash of what decides its output: the options it runs with, dgpipe's version
and the fingerprint of the stage before it (so a re-quantized checkpoint re-runs every later stage). The
build records it in the stage's StageRecord when the stage finishes; a later `dgpipe build` in the same
build dir compares and skips the stage when it matches and the stage's outputs are still on disk. An
interrupted build (Ctrl-C, a failure) therefore resumes from the first stage that did not finish: stage
outputs are written atomically, so a stage either finished and was recorded or left nothing behind.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.builddir import BuildManifest, StageRecord, load_manifest, read_blocks, save_manifest


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
    still on disk (a deferred engine stage has no engines dir, so only the main output is asked for)."""
    rec = manifest.stages.get(stage)
    if rec is None or rec.fingerprint != fp or output not in rec.outputs:
        return None
    return rec if (build_dir / rec.outputs[output]).exists() else None


def mark(build_dir: Path, stage: str, fp: str, seconds: float) -> BuildManifest:
    """Record the fingerprint of a stage that just finished (and recorded itself) in the build manifest,
    with the time the build measured for it (what a skipped stage reports later)."""
    man = load_manifest(build_dir)
    man.stages[stage].fingerprint = fp
    man.stages[stage].details["build_seconds"] = seconds
    save_manifest(build_dir, man)
    return man
