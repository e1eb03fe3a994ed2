"""How `dgpipe build` shows its events (pipeline.build.events): a live view for a person, JSON lines for a
script. Both get every event; the text view leaves a line per stage start and finish (and progress
lines when the console is not a terminal), and on a terminal a progress bar with ETA, redrawn on each
progress event and once a second (its elapsed clock), for steps that report no count.
"""

from __future__ import annotations

import json
import time
from typing import TextIO

from pipeline.build.events import (
    BuildFinished,
    BuildStarted,
    Event,
    StageFinished,
    StageProgress,
    StageSkipped,
    StageStarted,
)
from pipeline.build.summary import Row, human_size, render

PLAIN_EVERY_S = 2.0  # without a terminal: a progress line at most this often per phase (and on a new phase)


class JsonView:
    """`--json`: one compact JSON object per event, flushed as it happens."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, event: Event) -> None:
        self.stream.write(json.dumps(event.as_dict(), separators=(",", ":"), default=str) + "\n")
        self.stream.flush()

    def note(self, **fields: object) -> None:
        """A line that is not a build event (the log file's count, an interruption)."""
        self.stream.write(json.dumps(fields, separators=(",", ":"), default=str) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    m, s = divmod(round(seconds), 60)
    return f"ETA {m}:{s:02d}" if m else f"ETA {s}s"


class ConsoleView:
    """The text view: stage lines with the time since the build started, a bar per running phase."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console

        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.start = time.monotonic()
        self.live = self.console.is_terminal
        self.bars = None
        self.task = None
        self.last_plain: tuple[str, float] = ("", 0.0)

    def _t(self) -> str:
        return f"[dim]{time.monotonic() - self.start:7.1f}s[/]"

    def print(self, text: str) -> None:
        (self.bars.console if self.bars is not None else self.console).print(text)

    def echo(self, line: str) -> None:
        """A third-party line shown live (`-v`)."""
        from rich.markup import escape

        self.print(f"[dim]  | {escape(line)}[/]")

    def _stop_bar(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars, self.task = None, None

    def _bar(self, e: StageProgress) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self.bars is None:
            self.bars = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                console=self.console,
                refresh_per_second=1,  # the elapsed clock ticks through a step with no count (nvcc)
                transient=True,
                redirect_stdout=False,  # third-party output stays in build.log (pipeline/cli/capture.py)
                redirect_stderr=False,
            )
            self.bars.start()
            self.task = self.bars.add_task("", total=None, eta="")
        elif e.total is None and self.bars.tasks[0].total is not None:
            # rich's update keeps a total once set: a phase of unknown length gets a fresh bar, not "0/3"
            self.bars.remove_task(self.task)
            self.task = self.bars.add_task(f"{e.stage}: {e.phase}", total=None, eta="")
        self.bars.update(
            self.task, description=f"{e.stage}: {e.phase}", completed=e.done, total=e.total, eta=_eta(e.eta)
        )
        self.bars.refresh()

    def __call__(self, event: Event) -> None:
        if isinstance(event, StageProgress):
            if self.live:
                self._bar(event)
                return
            now = time.monotonic()
            key = f"{event.stage}:{event.phase}"
            if key != self.last_plain[0] or now - self.last_plain[1] >= PLAIN_EVERY_S:
                self.last_plain = (key, now)
                count = f" {event.done}/{event.total}" if event.total else ""
                eta = f" ({_eta(event.eta)})" if event.eta is not None else ""
                self.print(f"{self._t()} {event.stage}: {event.phase}{count}{eta}")
            return
        self._stop_bar()
        if isinstance(event, StageStarted):
            self.print(f"{self._t()} [bold]{event.stage}[/]: {event.what}")
        elif isinstance(event, BuildStarted):
            self.print(
                f"{self._t()} build {event.build_dir}: {event.model} -> {event.precision} "
                f"for {', '.join(event.targets)}"
            )
        elif isinstance(event, StageFinished):
            size = f", {human_size(event.size)}" if event.size else ""
            self.print(
                f"{self._t()} [green]done[/] [bold]{event.stage}[/] in {event.seconds:.1f}s: "
                f"{event.output}{size}"
            )
            for line in event.lines:
                self.print(f"           {line}")
        elif isinstance(event, StageSkipped):
            self.print(f"{self._t()} [yellow]skip[/] [bold]{event.stage}[/]: {event.reason} ({event.output})")
        elif isinstance(event, BuildFinished):
            rows = [Row(**r) for r in event.rows]
            self.console.print()
            for line in render(rows, event.engines, event.next_command, event.seconds):
                self.console.print(line, markup=False)

    def note(self, **fields: object) -> None:
        self.print(str(fields.get("text", "")))

    def close(self) -> None:
        self._stop_bar()
