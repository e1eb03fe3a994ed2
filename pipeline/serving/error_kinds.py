"""The kinds of error a dgpipe server answers with, shared by the Triton model, the clients and the OpenAI
frontend, and how a kind travels on the wire.

Triton's streaming transports carry only an error's message (gRPC ModelStreamInfer's `error_message`, the
`error` field of a generate_stream event), not its code, so the model writes the kind into the message as
a tag, `[timeout] request ran past its deadline ...`, and the clients read it back with `from_wire`: the
HTTP status is chosen from the kind, never from the wording of the message.

Stdlib only: the Triton model imports it inside tritonserver's Python stub.
"""

from __future__ import annotations

import re
from enum import Enum


class ErrorKind(str, Enum):
    """What went wrong, as the client should act on it."""

    INVALID_REQUEST = "invalid_request"  # fix the request: a value out of range, a bad prompt
    TIMEOUT = "timeout"  # the request ran past its deadline: ask for less or allow longer
    UNAVAILABLE = "unavailable"  # draining or shutting down, or unreachable: retry on another replica
    INTERNAL = "internal"  # a failure of the server's own: not the request's fault

    @property
    def status(self) -> int:
        """The HTTP status the kind stands for."""
        return _STATUS[self]

    @property
    def code(self) -> str | None:
        """OpenAI's error `code` for the kind (None for a plain invalid request, as OpenAI sends)."""
        return _CODE[self]

    def on_wire(self, message: str) -> str:
        """The message as the model sends it: tagged with its kind for the clients to read back."""
        return f"[{self.value}] {message}"

    @classmethod
    def from_code(cls, code: str | None, status: int) -> ErrorKind:
        """The kind of an OpenAI error (the frontend's `code`), by its status when the code is not one."""
        return next((k for k in cls if k.code is not None and k.code == code), None) or cls.from_status(
            status
        )

    @classmethod
    def from_status(cls, status: int) -> ErrorKind:
        """The kind an HTTP status stands for, for errors that carry no tag (Triton's own refusals)."""
        if status < 500:
            return cls.INVALID_REQUEST
        return {503: cls.UNAVAILABLE, 504: cls.TIMEOUT}.get(status, cls.INTERNAL)


_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}
_CODE = {
    ErrorKind.INVALID_REQUEST: None,
    ErrorKind.TIMEOUT: "timeout",
    ErrorKind.UNAVAILABLE: "service_unavailable",
    ErrorKind.INTERNAL: "internal_error",
}
_TAG = re.compile(r"\[(" + "|".join(k.value for k in ErrorKind) + r")\] ")


def from_wire(message: str, untagged: ErrorKind = ErrorKind.INVALID_REQUEST) -> tuple[ErrorKind, str]:
    """(kind, message without its tag) of an error message from the model. The tag may follow a prefix a
    transport added; a message without one (an error of Triton's own) is of kind `untagged`."""
    match = _TAG.search(message)
    if match is None:
        return untagged, message
    return ErrorKind(match.group(1)), message[: match.start()] + message[match.end() :]


def internal_error(where: str, error: BaseException) -> str:
    """The message of a failure of the server's own (a bug, a failed pass): where, and the exception."""
    return f"internal error {where}: {type(error).__name__}: {error}"
