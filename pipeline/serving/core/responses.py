"""What the core answers a request with, independent of the transport: output values by the schema's
output names (pipeline/serving/schema.py), or a typed failure. The adapter turns them into its own
responses (Triton tensors and errors); `None` sent on a channel releases a request without a response."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.errors import DgpipeError
from pipeline.serving.error_kinds import ErrorKind, internal_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outputs:
    """One response: schema output name -> its values (one value, or a list for a list output)."""

    values: dict[str, list[Any]]
    final: bool


@dataclass(frozen=True)
class Failure:
    """The final answer of a request that ends in an error."""

    kind: ErrorKind
    message: str


Reply = Outputs | Failure


class Channel(Protocol):
    """One request's way back to its client (the adapter's response sender)."""

    def send(self, reply: Reply | None) -> None:
        """Send a reply; a Failure, a final Outputs or None (release, nothing to say) ends the request."""

    def is_cancelled(self) -> bool:
        """Whether the client went away (the transport's cancellation)."""


def internal_failure(where: str, error: BaseException) -> Failure:
    """A failure of the server's own (a bug, a failed pass), naming where it happened and the exception."""
    return Failure(ErrorKind.INTERNAL, internal_error(where, error))


def refusal(where: str, error: Exception) -> Failure:
    """The answer to a request whose intake failed: the request's own problem (a DgpipeError, or a
    ValueError from a value it sent) is an invalid request; anything else is a failure of the server's own,
    answered as one (a 500, not a 400 blaming the request) and logged with its traceback."""
    if isinstance(error, DgpipeError | ValueError):
        return Failure(ErrorKind.INVALID_REQUEST, str(error))
    if isinstance(error, RecursionError):  # an input (messages, tools) nested past what its parser reads
        return Failure(ErrorKind.INVALID_REQUEST, f"an input nests deeper than it can be read ({error})")
    log.error("internal error %s", where, exc_info=error)
    return internal_failure(where, error)


def piece(
    text: str,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    cached_tokens: int | None = None,
) -> Outputs:
    """A committed piece of a streamed answer, with the token counts so far when the request asked (a
    client can report usage on every chunk), and its tokens' log-probabilities when it asked for them."""
    values: dict[str, list[Any]] = {"text_output": [text]}
    if logprobs is not None:
        values["logprobs"] = [json.dumps(logprobs)]
    _add_counts(values, input_tokens, output_tokens, cached_tokens)
    return Outputs(values, final=False)


def _add_counts(
    values: dict[str, list[Any]], input_tokens: int | None, output_tokens: int | None, cached: int | None
) -> None:
    """The token counts a request asked for (None: not asked) as their outputs."""
    for name, count in (("num_input_tokens", input_tokens), ("num_cached_tokens", cached),
                        ("num_output_tokens", output_tokens)):  # fmt: skip
        if count is not None:
            values[name] = [count]


def draft(text: str, step: int) -> Outputs:
    """The canvas after a denoise step (`stream_drafts`): marked by denoise_steps on a non-final response."""
    return Outputs({"text_output": [text], "denoise_steps": [step]}, final=False)


def final(
    text: str,
    reason: str,
    steps: list[int],
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    cached_tokens: int | None = None,
) -> Outputs:
    """The last response of a request answered with a result; token counts only when the request asked,
    the log-probabilities of the tokens not sent yet (all of them, when not streaming) likewise."""
    values: dict[str, list[Any]] = {"text_output": [text], "finish_reason": [reason]}
    if logprobs is not None:
        values["logprobs"] = [json.dumps(logprobs)]
    _add_counts(values, input_tokens, output_tokens, cached_tokens)
    values["denoise_steps"] = steps
    return Outputs(values, final=True)


ALIVE = Outputs({}, final=True)  # the answer to a health ping
