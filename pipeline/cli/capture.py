"""Third-party output of a long command goes to a log file, not over the command's own lines.

Dependencies write to the terminal in every way there is: python logging (transformers installs its own
stderr handler), warnings, print() (ModelOpt's "Tied weight (declared): dropping ... alias key(s)"), C++
libraries writing to file descriptor 2, subprocesses such as nvcc. Only a redirect of the descriptors
catches all of them, so for the duration of `capture` descriptors 1 and 2 (and sys.stdout/sys.stderr) feed
a pipe; a thread copies what arrives into the log file and, with `echo` (`-v`), to the console as well.
The command's own output goes through `Capture.stdout`/`Capture.stderr`, duplicates of the terminal taken
before the redirect. The log file is appended to (a resumed build keeps the earlier run's log) and only
created once its directory exists, so a command refused before it writes anything leaves no file; what
arrived before then is kept in memory and written on exit (or shown on the console when no directory came).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO


class Capture:
    """What `capture` yields: the console streams for the command's own output, and the log's line count."""

    def __init__(self, log: Path, stdout: TextIO, stderr: TextIO, echo: Callable[[str], None] | None) -> None:
        self.log = log
        self.stdout = stdout
        self.stderr = stderr
        self.echo = echo
        self.lines = 0  # third-party lines seen in this run
        self._pending: list[str] = []  # lines that arrived before the log's directory existed
        self._file: TextIO | None = None

    def _open(self) -> TextIO | None:
        if self._file is None and self.log.parent.is_dir():
            self._file = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in finish)
            stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            self._file.write(f"--- {' '.join(['dgpipe', *sys.argv[1:]])} ({stamp}) ---\n")
        return self._file

    def take(self, line: str) -> None:
        """One line of third-party output: into the log (or pending), and to `echo` when verbose."""
        if not line.strip():
            return
        self.lines += 1
        f = self._open()
        if f is None:
            self._pending.append(line)
        else:
            for held in self._pending:
                f.write(held + "\n")
            self._pending.clear()
            f.write(line + "\n")
            f.flush()
        if self.echo is not None:
            self.echo(line)

    def finish(self) -> None:
        f = self._open() if self._pending or self._file is not None else None  # no line: no log file
        if f is not None:
            for held in self._pending:
                f.write(held + "\n")
            f.close()
        elif self._pending and self.echo is None:  # nowhere to keep them: the user sees them
            for held in self._pending:
                self.stderr.write(held + "\n")
        self._pending.clear()


def _console(stream: TextIO, fd: int) -> tuple[TextIO, bool]:
    """A stream to the console that survives the redirect of `fd`: a duplicate of the descriptor when
    `stream` writes to it (the terminal), else `stream` itself (a test's in-memory capture)."""
    try:
        if stream.fileno() == fd:
            dup = os.dup(fd)
            return open(dup, "w", buffering=1, encoding="utf-8", errors="replace", closefd=True), True
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        pass
    return stream, False


@contextlib.contextmanager
def capture(log: Path, echo: Callable[[str], None] | None = None) -> Iterator[Capture]:
    """Descriptors 1 and 2 into `log` while the block runs (see the module doc); `echo(line)` also gets
    each line (the `-v` view). Restored on any exit, Ctrl-C included."""
    sys.stdout.flush()
    sys.stderr.flush()
    out, out_owned = _console(sys.stdout, 1)
    err, err_owned = _console(sys.stderr, 2)
    cap = Capture(Path(log), out, err, echo)
    saved = os.dup(1), os.dup(2)
    read_fd, write_fd = os.pipe()
    reader = threading.Thread(target=_drain, args=(read_fd, cap), name="dgpipe-capture", daemon=True)
    reader.start()
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    py_streams = sys.stdout, sys.stderr
    redirected = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    sys.stdout = sys.stderr = redirected
    try:
        yield cap
    finally:
        redirected.flush()
        sys.stdout, sys.stderr = py_streams
        redirected.close()
        os.dup2(saved[0], 1)  # closes the pipe's last write ends: the reader sees end of file
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        reader.join(timeout=10)
        cap.finish()
        for stream, owned in ((out, out_owned), (err, err_owned)):
            if owned:
                stream.close()
            else:
                stream.flush()


def _drain(fd: int, cap: Capture) -> None:
    """The reader thread: whole lines from the pipe to `cap.take` until every write end is closed."""
    buf = b""
    with open(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                cap.take(raw.decode("utf-8", "replace").rstrip("\r").split("\r")[-1])
    if buf:
        cap.take(buf.decode("utf-8", "replace").split("\r")[-1])
