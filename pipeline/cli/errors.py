"""The one error map: exception type -> exit code and one line on stderr; `main()` applies it once.

User errors (DgpipeError and its kinds) exit 2 with `error: ...`; so do the file system's refusals (OSError:
a path that is a file where a directory is needed, unwritable, missing, a full disk), named with their
path. DGPIPE_DEBUG=1 also shows the traceback. Anything not in the map is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from pipeline.cli import output
from pipeline.errors import DgpipeError


def _os_error(e: BaseException) -> str:
    assert isinstance(e, OSError)
    where = f"{e.filename}: " if e.filename else ""
    return f"error: {where}{e.strerror or e} (check the path, its permissions and free space)"


def terminate_like_interrupt() -> None:
    """SIGTERM (kubectl delete, a CI cancel, `timeout`) unwinds like Ctrl-C: atomic writes remove their temp
    dirs and a build says how to resume (typer exits 130 for both)."""
    import signal

    def _raise(signum, frame):
        # a second SIGTERM ends the process at once: the first waits for a native call (a TensorRT build,
        # a calibration pass) to return before it can unwind
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


ERRORS: dict[type[BaseException], tuple[int, Callable[[BaseException], str]]] = {
    DgpipeError: (2, lambda e: f"error: {e}"),
    OSError: (2, _os_error),
}
# Ctrl-C (and SIGTERM, `terminate_like_interrupt`) is not here: typer ends the command with exit code 130
# itself, before this table could see it (`dgpipe build` says how to resume first)


def handled() -> tuple[type[BaseException], ...]:
    return tuple(ERRORS)


def mapped(exc: BaseException) -> tuple[int, str]:
    """(exit code, the one line) for a handled `exc`; an unexpected one is exit 1 with its type and text
    (its traceback goes to stderr as Python prints it)."""
    kind = next((k for k in type(exc).__mro__ if k in ERRORS), None)
    if kind is None:
        return 1, f"error: {type(exc).__name__}: {exc}"
    code, message = ERRORS[kind]
    return code, message(exc)


def report(exc: BaseException) -> int:
    """Print the mapped line for `exc` (after its traceback with DGPIPE_DEBUG=1); return the exit code."""
    code, line = mapped(exc)
    if os.environ.get("DGPIPE_DEBUG", "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    output.line(line, err=True)
    return code
