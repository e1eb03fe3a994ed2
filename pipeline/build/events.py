"""What `dgpipe build` tells its caller while it runs: typed events, one per thing a person wants to see.

The build library never prints; it hands these to an `emit` callable. The CLI renders them (a live view on a
terminal, plain lines otherwise) or streams them as JSON lines with `--json`, so a script and a person see
the same facts in the same order: the build starts, each stage starts, reports progress with an ETA,
finishes (or is skipped because its inputs are unchanged), and the build ends with its summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """Base of every build event; `kind` names it in the JSON stream."""

    kind = "event"

    def as_dict(self) -> dict[str, Any]:
        return {"event": self.kind, **asdict(self)}


@dataclass(frozen=True)
class BuildStarted(Event):
    kind = "build_started"
    build_dir: str
    model: str
    precision: str
    targets: list[str]


@dataclass(frozen=True)
class StageStarted(Event):
    kind = "stage_started"
    stage: str
    what: str  # one line: what the stage does with what


@dataclass(frozen=True)
class StageProgress(Event):
    kind = "progress"
    stage: str
    phase: str  # e.g. "calibration", "export graph"
    done: int
    total: int | None
    eta: float | None  # seconds left in this phase at the rate so far; None before the first step


@dataclass(frozen=True)
class StageFinished(Event):
    kind = "stage_finished"
    stage: str
    seconds: float
    output: str  # the stage's main artifact
    size: int  # bytes under `output`
    gate: str | None  # the stage's accuracy/validity gate result, None where the stage has none
    lines: list[str] = field(default_factory=list)  # the stage's own summary lines
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageSkipped(Event):
    kind = "stage_skipped"
    stage: str
    reason: str
    output: str
    size: int
    seconds: float  # what the stage took when it ran


@dataclass(frozen=True)
class BuildFinished(Event):
    kind = "build_finished"
    seconds: float
    rows: list[dict[str, Any]]  # one per stage: pipeline.build.summary.Row as a dict
    engines: dict[str, dict[str, Any]]  # target -> status (built/deferred) and the node command
    next_command: str
    summary: dict[str, Any]  # build dir, precision, targets and each stage's figures


Emit = Callable[[Event], None]


class PhaseProgress:
    """Counts the steps of one phase of a stage and emits StageProgress with an ETA from the rate so far.
    `advance(k)` is the plain `progress(k)` callback the stages already take."""

    def __init__(self, emit: Emit, stage: str, phase: str, total: int | None, clock=time.monotonic) -> None:
        self.emit, self.stage, self.phase, self.total = emit, stage, phase, total
        self.clock = clock
        self.start = clock()
        self.done = 0
        self._send()

    def _send(self) -> None:
        self.emit(StageProgress(self.stage, self.phase, self.done, self.total, self.eta()))

    def eta(self) -> float | None:
        if not self.done or self.total is None:
            return None
        rate = (self.clock() - self.start) / self.done
        return round(max(self.total - self.done, 0) * rate, 1)

    def advance(self, k: int = 1, phase: str | None = None) -> None:
        """`k` more steps done; `phase` renames what runs now (a stage whose steps have names)."""
        self.done += k
        if phase is not None:
            self.phase = phase
        self._send()
