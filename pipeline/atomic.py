"""Atomic writes: every artifact appears whole or not at all (a crash or Ctrl-C leaves the old one)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import DgpipeError


def atomic_write_text(path: Path, text: str) -> Path:
    """Write to a temp file beside `path`, then rename: a crash never leaves a half-written file."""
    return atomic_write_bytes(path, text.encode())


def make_dir(d: Path) -> None:
    """`d` and its parents, or a DgpipeError naming the path that is a file where a directory is needed."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        blocking = next((p for p in (d, *d.parents) if p.exists() and not p.is_dir()), d)
        raise DgpipeError(
            f"{blocking}: a file is in the way of directory {d}", "pass a directory path"
        ) from e


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """`atomic_write_text` for bytes."""
    if path.is_dir():
        raise DgpipeError(f"{path}: is a directory, not a file", "pass a file path")
    make_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; an artifact is as readable as a plain write makes it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


Marker = str | Callable[[Path], bool]  # a glob of a file only this kind of output has, or a test of the dir


def json_key(name: str, key: str) -> Callable[[Path], bool]:
    """A marker: the directory's JSON file `name` is an object holding `key` (what dgpipe writes there)."""

    def marked(d: Path) -> bool:
        try:
            return key in json.loads((d / name).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            return False

    return marked


def check_replaceable(final: Path, kind: str, marker: Marker) -> None:
    """Refuse to replace `final` unless it is absent, an empty directory, or an earlier output of this kind
    (`marker`: a glob of a file only such an output holds, or a test of the directory): an output directory is
    replaced as a whole, so `--output ~/models` must not delete what the user keeps there."""
    final = Path(final)
    if not final.exists():
        return
    earlier = marker(final) if callable(marker) else any(final.glob(marker))
    if not final.is_dir() or (any(final.iterdir()) and not earlier):
        raise DgpipeError(
            f"{final}: exists and is not {kind}",
            "it would be replaced as a whole: pass a new or empty directory",
        )


def atomic_dir(final: Path, kind: str, marker: Marker):
    """Context manager yielding a temp dir next to `final` that replaces it only on success; `final` must be
    replaceable (`check_replaceable`: absent, empty, or an earlier output of `kind`, marked by `marker`)."""
    final = Path(final)
    check_replaceable(final, kind, marker)

    @contextlib.contextmanager
    def _cm():
        make_dir(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            yield tmp
            os.chmod(tmp, 0o755)
            for f in tmp.rglob("*"):
                os.chmod(f, 0o755 if f.is_dir() else 0o644)
            if final.exists():
                old = final.with_name(f".{final.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            io = _os_error_in(e, final)
            if io is not None:
                raise io from e
            raise

    return _cm()


# what the file system refuses a writer of the output: no space, no quota, read-only, an I/O failure
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def _os_error_in(e: BaseException, where: Path) -> OSError | None:
    """The file system's refusal to write the output that a writer reports as its own error type
    (safetensors' SafetensorError "I/O error: No space left on device (os error 28)"), as the OSError it
    is, naming the output dir. Other errors (an input file a Rust reader cannot open) stay as they are."""
    m = None if isinstance(e, OSError) else re.search(r"\(os error (\d+)\)", str(e))
    if m is None or int(m[1]) not in _WRITE_ERRNOS:
        return None
    return OSError(int(m[1]), os.strerror(int(m[1])), str(where))
