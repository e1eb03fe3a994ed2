"""The one place dgpipe talks to the terminal: lines, JSON, tables, colored words, spinners, progress bars.

Libraries return data or call a `say`/`progress` callable; the commands hand them the ones made here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import typer

from pipeline.stages import StageResult


def line(text: str = "", err: bool = False, nl: bool = True) -> None:
    """One line (or a partial one with nl=False) on stdout, or on stderr with err=True."""
    typer.echo(text, err=err, nl=nl)


def lines(texts: Iterable[str], err: bool = False) -> None:
    for text in texts:
        typer.echo(text, err=err)


def json_out(obj: object, compact: bool = False) -> None:
    """`--json`: the whole result on stdout, nothing else there. `compact`: one line with no spaces, so a
    command answering several inputs prints JSON Lines (one object per input, in order)."""
    from pipeline.bench.results import finite  # NaN and infinities as null: strict JSON, as the files save it

    if compact:
        typer.echo(json.dumps(finite(obj), separators=(",", ":"), default=str, allow_nan=False))
    else:
        typer.echo(json.dumps(finite(obj), indent=2, default=str, allow_nan=False))


def show(data: Any, as_json: bool, render: Callable[[Any], str | Iterable[str]]) -> None:
    """JSON with --json, else the text `render` makes of the same data."""
    if as_json:
        json_out(data)
        return
    text = render(data)
    lines([text] if isinstance(text, str) else text)


def stage(result: StageResult, as_json: bool) -> None:
    """A build stage's result: its figures with --json, else its summary lines."""
    if as_json:
        json_out(result.as_dict())
    else:
        lines(result.summary)


def table(header: str, rows: Iterable[str]) -> None:
    """A fixed-width table: the header line, then one preformatted line per row."""
    lines([header, *rows])


def flag(text: str, ok: bool) -> str:
    """A word in green (ok) or red (not ok)."""
    return typer.style(text, fg="green" if ok else "red")


def saved(paths: Sequence[Path | str], as_json: bool, label: str = "results") -> None:
    """Say where results went: on stdout after a text report, on stderr when stdout carries JSON."""
    typer.echo(f"{label}: {', '.join(str(p) for p in paths)}", err=as_json)


@contextmanager
def progress(
    label: str, total: int | None, disable: bool = False, console: TextIO | None = None
) -> Iterator[Callable[[int], None]]:
    """A transient progress bar; yields `advance(k)` for the library's `progress` callback. `console`: the
    terminal stream to draw on while a capture (pipeline/cli/capture.py) holds stdout and stderr."""
    with progress_bars(disable, console) as bars:
        task = bars.add_task(label, total=total)
        yield lambda k=1: bars.advance(task, k)


@contextmanager
def progress_bars(disable: bool = False, console: TextIO | None = None):
    """Several transient bars (rich Progress) for a library that takes a progress factory."""
    from rich.console import Console
    from rich.progress import Progress

    # on a stream that is no terminal a bar draws nothing but leaves a blank line before what follows
    disable = disable or (console is not None and not console.isatty())
    with Progress(
        transient=True, disable=disable, console=Console(file=console) if console else None
    ) as bars:
        yield bars
