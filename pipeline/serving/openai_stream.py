"""The Triton side of the OpenAI frontend: the stream of response chunks one request gets from the model
(gRPC streaming, pipeline/serving/client.py), read one chunk at a time, closed even from a cancelled task,
and its failures as the frontend's errors (status and code from the error's kind)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio

from pipeline.errors import DgpipeError
from pipeline.serving.client import AsyncTriton, TritonError
from pipeline.serving.error_kinds import ErrorKind
from pipeline.serving.openai_schema import RequestError

# (served model's name, Triton inputs by schema name) -> the model's response chunks (client.grpc_generate's
# dicts); closing the generator before its end cancels the request in Triton
TritonStream = Callable[[str, dict[str, Any]], AsyncGenerator[dict[str, Any], None]]
Chunks = AsyncGenerator[dict[str, Any], None]
END = object()  # what `pull` returns once the stream has ended


def triton_stream(grpc_url: str) -> TritonStream:
    """The production backend: gRPC streaming on the event loop (client.AsyncTriton: one channel, no
    threads). Its `aclose` runs at the app's shutdown."""
    return AsyncTriton(grpc_url).stream


def from_triton(e: Exception) -> RequestError:
    """A failure talking to Triton as the frontend's error, by its kind: the model's refusal stays a 400,
    a draining model or unreachable Triton is a 503, a request past its deadline a 504, a failure of the
    model's own a 500 (code triton_error: it happened behind the frontend)."""
    if isinstance(e, TritonError):
        code = "triton_error" if e.kind is ErrorKind.INTERNAL else e.kind.code
        return RequestError(str(e), None, e.kind.status, code)
    unavailable = ErrorKind.UNAVAILABLE
    return RequestError(f"the model server is unavailable: {e}", None, unavailable.status, unavailable.code)


async def pull(chunks: Chunks) -> Any:
    """The next chunk, END at the end; Triton failures as RequestError."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return END
    except (TritonError, DgpipeError) as e:
        raise from_triton(e) from e


async def close(chunks: Chunks) -> None:
    """End the Triton stream (cancelling the request if it is still running), even from a cancelled task
    (the client went away): shielded, so the cleanup itself is not cancelled."""
    with anyio.CancelScope(shield=True):
        await chunks.aclose()


async def merged(streams: list[Chunks], firsts: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, chunk) of several streams as their chunks come (each stream's first chunk already
    read: `firsts`, END for one already over); a failure of any stream ends it (RequestError)."""
    for i, first in enumerate(firsts):
        if first is not END:
            yield i, first
    live = [i for i, first in enumerate(firsts) if first is not END]
    if len(streams) == 1:  # one choice: plain reads, no tasks
        while live and (item := await pull(streams[0])) is not END:
            yield 0, item
        return
    pending = {asyncio.ensure_future(pull(streams[i])): i for i in live}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                i = pending.pop(fut)
                item = fut.result()
                if item is not END:
                    yield i, item
                    pending[asyncio.ensure_future(pull(streams[i]))] = i
    finally:  # the reads still pending are ended before their streams are closed
        for fut in pending:
            fut.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pending, return_exceptions=True)
