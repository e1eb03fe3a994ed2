"""Request deadlines: every request may run for its `timeout_s` (at most the server's limit) once it has a
batch slot, then it is cancelled and answered with a timeout, so work a client abandoned is bounded even
where the transport does not pass the disconnect on (Triton's HTTP)."""

from __future__ import annotations

from pipeline.serving.schema import PAST_DEADLINE


def overdue(admitted: float, timeout_s: float, now: float) -> bool:
    """Running longer than its deadline. Time queued does not count (`admitted` 0: no slot yet): the queue
    moves because every running request is bounded, and a full batch must not expire the requests waiting
    behind it."""
    return admitted > 0 and now - admitted > timeout_s


def expired_message(timeout_s: float, canvases: int, server_limit: float) -> str:
    """What a request ended by its deadline is told: how far it got and what to ask for instead."""
    return (
        f"{PAST_DEADLINE} of {timeout_s:g} s and was stopped after {canvases} canvas(es); ask for fewer "
        f"max_tokens or max_denoising_steps, or a longer timeout_s (this server allows up to "
        f"{server_limit:g} s)"
    )
