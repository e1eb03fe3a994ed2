"""The table `dgpipe build` ends with: per stage its time, output, size and gate result; the engines built
here or deferred to the target node (with the node's command); and the next command to run.

Built from the build manifest and the stage events, so a resumed build reports skipped stages with the
figures they were recorded with.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.builddir import LAYOUT, BuildManifest


@dataclass(frozen=True)
class Row:
    stage: str
    status: str  # "ran" or "skipped" (unchanged inputs, from an earlier run)
    seconds: float
    output: str  # relative to the build dir when inside it
    size: int  # bytes
    gate: str  # the stage's gate result, or what to run for it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tree_size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (0 when absent)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def engines(manifest: BuildManifest, build_dir: Path) -> dict[str, dict[str, Any]]:
    """target -> {"status": built | up to date | deferred, "reason", "command"} from the engine stage. The
    command runs in the build dir (its paths are the build's, relative: the node mounts the build elsewhere),
    so it is shown with the `cd` that makes it runnable from anywhere."""
    rec = manifest.stages.get("engine")
    found = rec.details.get("engines", {}) if rec else {}
    return {
        t: {
            "status": e.get("status", "unknown"),
            "reason": e.get("reason"),
            "command": f"cd {shlex.quote(str(build_dir))} && {shlex.join(e['command'])}"
            if e.get("command")
            else None,
        }
        for t, e in found.items()
    }


def next_command(build_dir: Path, engine_status: dict[str, dict[str, Any]]) -> str:
    """What a user runs next: serve the repository here, or render the deployment when the engines are
    built on the target node."""
    repo = build_dir / LAYOUT["model_repository"]
    if engine_status and all(e["status"] == "deferred" for e in engine_status.values()):
        manifests = (
            f"dgpipe manifests --build-dir {build_dir} --target TARGET --image REGISTRY/dgpipe-triton:TAG"
        )
        return f"dgpipe serve --repo {repo}   (or: {manifests})"
    return f"dgpipe serve --repo {repo}"


def render(
    rows: list[Row], engine_status: dict[str, dict[str, Any]], next_cmd: str, seconds: float
) -> list[str]:
    """The summary as text lines: the stage table, one line per engine target, the next command."""
    header = ("stage", "status", "seconds", "output", "size", "gate")
    cells = [(r.stage, r.status, f"{r.seconds:.1f}", r.output, human_size(r.size), r.gate) for r in rows]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]

    def fmt(c: tuple) -> str:
        return "  ".join(str(v).ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()

    out = [fmt(header), *(fmt(c) for c in cells)]
    for target, e in engine_status.items():
        if e["status"] == "deferred":
            out.append(f"engine {target}: deferred to the target node ({e['reason']}): {e['command']}")
        else:
            out.append(f"engine {target}: {e['status']}")
    out.append(f"build finished in {seconds:.1f}s; next: {next_cmd}")
    return out
