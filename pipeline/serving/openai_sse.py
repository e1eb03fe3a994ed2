"""The server-sent events of a streamed OpenAI response: a chunk per committed canvas, the finish, usage
when asked, `data: [DONE]`; drafts (`stream_drafts`) as their own `event: dgpipe.draft` events beside the
standard chunks; an error after the 200 as an error event, as OpenAI's servers do."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pipeline.serving.client import Reply, draft_of
from pipeline.serving.openai_errors import error_body
from pipeline.serving.openai_schema import RequestError
from pipeline.serving.openai_stream import END, Chunks, close, pull

DONE = "data: [DONE]\n\n"


def usage(reply: Reply) -> dict[str, int]:
    prompt, completion = reply.num_input_tokens or 0, reply.num_output_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class EventWriter:
    """The events of one response, each with the response's head (id, object, created, model)."""

    def __init__(
        self, head: dict[str, Any], chat: bool, include_usage: bool, continuous_usage: bool = False
    ) -> None:
        self.head, self.chat, self.include_usage = head, chat, include_usage
        self.continuous_usage = (
            continuous_usage  # usage so far on every chunk (vLLM's continuous_usage_stats)
        )
        self.extra: dict[str, Any] = {"usage": None} if include_usage or continuous_usage else {}

    def role(self, first: Any = None) -> str:
        """A chat stream opens with the assistant's role; with continuous usage it already carries the
        prompt's tokens and no completion tokens (as vLLM's does), read from the model's first chunk."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        extra = self.extra
        if self.continuous_usage and isinstance(first, dict) and first.get("num_input_tokens") is not None:
            prompt = Reply()
            prompt.add({"num_input_tokens": first["num_input_tokens"], "num_output_tokens": 0})
            extra = {"usage": usage(prompt)}
        return event({**self.head, "choices": [choice], **extra})

    def chunk(self, piece: str | None, finish: str | None, reply: Reply | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = {} if piece is None else {"content": piece}
        else:
            choice["text"] = piece or ""
        extra = {"usage": usage(reply)} if self.continuous_usage and reply is not None else self.extra
        return event({**self.head, "choices": [choice], **extra})

    def draft(self, canvas: int, step: int, text: str) -> str:
        payload = {**self.head, "object": "dgpipe.draft", "choices": []}
        payload["dgpipe"] = {"canvas": canvas, "step": step, "text": text}
        return f"event: dgpipe.draft\n{event(payload)}"

    def usage(self, reply: Reply) -> str:
        return event({**self.head, "choices": [], "usage": usage(reply)})

    def error(self, e: RequestError) -> str:
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        return event(error_body(e.message, kind, code=e.code))


async def sse_events(writer: EventWriter, first: Any, chunks: Chunks, reply: Reply) -> AsyncIterator[str]:
    """The SSE events; a client that goes away mid-stream cancels its request in Triton."""
    try:
        async for ev in _events(writer, first, chunks, reply):
            yield ev
    finally:
        await close(chunks)


async def _events(writer: EventWriter, first: Any, chunks: Chunks, reply: Reply) -> AsyncIterator[str]:
    if writer.chat:
        yield writer.role(first)
    item, canvases = first, 0
    try:
        while item is not END:
            draft = draft_of(item)
            if draft is not None:
                yield writer.draft(canvases, *draft)
            else:
                piece = reply.add(item)
                if piece:
                    canvases += 1
                    yield writer.chunk(piece, None, reply)
                if item.get("finish_reason"):
                    yield writer.chunk(None, reply.finish_reason, reply)
            item = await pull(chunks)
    except RequestError as e:  # after a 200: the error travels as an event
        yield writer.error(e)
        yield DONE
        return
    if writer.include_usage:
        yield writer.usage(reply)
    yield DONE
