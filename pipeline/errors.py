"""One exception type for everything a user can fix, so the CLI prints one line instead of a traceback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class DgpipeError(Exception):
    """A problem the user can fix: the message names what is wrong, `hint` says how to fix it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} ({self.hint})" if self.hint else base


class CheckpointError(DgpipeError):
    """The checkpoint directory is missing, incomplete or inconsistent with its config."""


class SamplerError(DgpipeError):
    """A sampler setting is outside the range the algorithm is defined for."""


class InputError(DgpipeError):
    """A prompt, template or request field is unusable (too long, empty, wrong tokens)."""


@contextmanager
def validation_error(
    message: Callable[[str, str], str], error: type[DgpipeError] = DgpipeError, hint: str | None = None
) -> Iterator[None]:
    """Turn a pydantic ValidationError raised inside the block into one user error line:
    `message(where, msg)` of the first error, `where` being its dotted field path ("text_config.hidden_size")."""
    try:
        yield
    except Exception as e:
        from pydantic import ValidationError  # here, so importing this module stays instant

        if not isinstance(e, ValidationError):
            raise
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise error(message(where, first["msg"]), hint) from e


def error_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line for a report: its type and its message's first line (an empty
    message gives the type alone)."""
    first = (str(e).strip().splitlines() or [""])[0][:limit]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
