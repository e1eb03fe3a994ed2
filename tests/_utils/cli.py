"""The `dgpipe` command as a user runs it: the CLI of this tree in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.resources import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent
DGPIPE = [sys.executable, "-m", "pipeline.cli"]
# A shell with nothing of the caller's: no DGPIPE_* settings, no virtual environment on PATH.
BARE_ENV = {"PATH": "/usr/bin:/bin"}


def dgpipe(
    *args: str,
    ok: bool = False,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    base_env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run `dgpipe ARGS` and return the finished process (text stdout/stderr).

    The child imports this tree (PYTHONPATH) with one OpenMP thread. It inherits this process's
    environment unless `base_env` replaces it (BARE_ENV: a fresh shell); `env` adds to either.
    `ok=True` asserts exit status 0 and shows stderr when not."""
    base = dict(os.environ) if base_env is None else dict(base_env)
    full_env = {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [*DGPIPE, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc
