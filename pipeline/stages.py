"""What a build stage returns: one shape for quantize, export, engine and package, whichever command ran it.

`dgpipe build` collects them into its summary and each stage's own command prints one through
`pipeline.cli.output.stage` (its summary lines, or `as_dict()` with --json), so a stage's report reads the
same wherever it ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StageResult:
    """One stage's outcome: what it wrote, how long it took, lines for a person, figures for a script."""

    stage: str  # "quantize", "export", "engine", "package"
    paths: dict[str, Path]  # artifact name -> where the stage wrote it
    seconds: float
    summary: list[str]  # one line per fact a person wants to read
    details: dict[str, Any] = field(default_factory=dict)  # the stage's own figures (JSON-ready)

    def as_dict(self) -> dict[str, Any]:
        """The stage's figures with its name, paths and time: what `--json` prints."""
        return {
            "stage": self.stage,
            "paths": {k: str(v) for k, v in self.paths.items()},
            **self.details,
            "seconds": self.seconds,
        }
