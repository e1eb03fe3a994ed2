"""The server-sent events of a streamed OpenAI response: a chunk per committed canvas of each choice (its
`index`), each choice's finish, usage when asked, `data: [DONE]`; drafts (`stream_drafts`) as their own
`event: dgpipe.draft` events beside the standard chunks; an error after the 200 as an error event, as
OpenAI's servers do. A chunk carries the log-probabilities of its own tokens when the request asked for
them. A forced tool call is sent whole with its finish: its text is the call's JSON, which is only a call
once it is complete. An "auto" reply streams its text as content up to its first `<tool_call>` (holding
back a tail that could begin one), as vLLM's tool parsers do, and its calls come with its finish (whole
when the request asked for log-probabilities, which are per token of the whole reply)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pipeline.serving.client import Reply, draft_of
from pipeline.serving.openai_choices import logprobs_of
from pipeline.serving.openai_errors import error_body
from pipeline.serving.openai_schema import RequestError
from pipeline.serving.openai_stream import Chunks, close, merged

DONE = "data: [DONE]\n\n"
CALL_OPEN = "<tool_call>"  # where a Hermes-format reply's calls begin (openai_tools.HERMES_CALL)


def content_end(text: str) -> int:
    """How much of an "auto" reply's text is certainly content: up to its first CALL_OPEN, less a tail that
    could be the start of one (sent once the next piece shows it is not)."""
    if not text.strip():
        return 0  # whitespace alone: no content at all if calls follow
    at = text.find(CALL_OPEN)
    if at >= 0:
        return at if text[:at].strip() else 0
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:k]):
            return len(text) - k
    return len(text)


def usage(replies: list[Reply]) -> dict[str, Any]:
    """The prompt counted once, the completion tokens of every choice (OpenAI's usage for n > 1), and of the
    prompt's, those the prefix cache held (`prompt_tokens_details.cached_tokens`, the first choice's)."""
    first = next((r for r in replies if r.num_input_tokens is not None), None)
    prompt = first.num_input_tokens if first is not None else 0
    completion = sum(r.num_output_tokens or 0 for r in replies)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if first is not None and first.num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": first.num_cached_tokens}
    return out


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class EventWriter:
    """The events of one response, each with the response's head (id, object, created, model)."""

    def __init__(
        self,
        head: dict[str, Any],
        chat: bool,
        include_usage: bool,
        continuous_usage: bool = False,
        logprobs: bool = False,
        plan: Any = None,
    ) -> None:
        self.head, self.chat, self.include_usage = head, chat, include_usage
        # usage so far on every chunk (vLLM's continuous_usage_stats)
        self.continuous_usage = continuous_usage
        self.logprobs = logprobs
        self.plan = plan  # openai_tools.ToolPlan: the reply becomes tool calls (None: plain text)
        self.extra: dict[str, Any] = {"usage": None} if include_usage or continuous_usage else {}

    def role(self, index: int = 0, first: Any = None) -> str:
        """A chat stream opens each choice with the assistant's role; with continuous usage it already
        carries the prompt's tokens and no completion tokens (as vLLM's does), read from the model's first
        chunk."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        extra = self.extra
        if self.continuous_usage and isinstance(first, dict) and first.get("num_input_tokens") is not None:
            prompt = Reply()
            counts = {k: first.get(k) for k in ("num_input_tokens", "num_cached_tokens")}
            prompt.add({**counts, "num_output_tokens": 0})
            extra = {"usage": usage([prompt])}
        return event({**self.head, "choices": [choice], **extra})

    def chunk(
        self,
        piece: str | None,
        finish: str | None,
        replies: list[Reply] | None = None,
        index: int = 0,
        logprobs: list[dict[str, Any]] | None = None,
        offset: int = 0,
        delta: dict[str, Any] | None = None,
    ) -> str:
        lp = logprobs_of(logprobs, self.chat, offset) if self.logprobs and logprobs is not None else None
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": lp}
        if self.chat:
            choice["delta"] = delta if delta is not None else ({} if piece is None else {"content": piece})
        else:
            choice["text"] = piece or ""
        extra = {"usage": usage(replies)} if self.continuous_usage and replies is not None else self.extra
        return event({**self.head, "choices": [choice], **extra})

    @property
    def streams_content(self) -> bool:
        """An "auto" reply's content is streamed before its calls (not with log-probabilities: they are
        sent with the whole reply)."""
        return self.plan is not None and self.plan.choice == "auto" and not self.logprobs

    def tool_calls(self, reply: Reply, replies: list[Reply], index: int, sent: int = 0) -> str:
        """A reply's tool calls with its finish, and what is left of its content after the `sent` characters
        already streamed (openai_choices.whole_choice's rule)."""
        content, calls = self.plan.calls(reply.text)
        if not calls:
            return self.chunk(reply.text[sent:], reply.finish_reason, replies, index, reply.logprobs)
        delta: dict[str, Any] = {
            "content": (content[sent:] or None) if content is not None else None,
            "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)],
        }
        finish = "tool_calls" if reply.finish_reason == "stop" else reply.finish_reason
        calls = self.chunk(None, None, replies, index, reply.logprobs, delta=delta)
        return calls + self.chunk(None, finish, replies, index, None, delta={})

    def draft(self, canvas: int, step: int, text: str, index: int = 0) -> str:
        payload = {**self.head, "object": "dgpipe.draft", "choices": []}
        payload["dgpipe"] = {"canvas": canvas, "step": step, "text": text, "index": index}
        return f"event: dgpipe.draft\n{event(payload)}"

    def usage(self, replies: list[Reply]) -> str:
        return event({**self.head, "choices": [], "usage": usage(replies)})

    def error(self, e: RequestError) -> str:
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        return event(error_body(e.message, kind, code=e.code))


async def sse_events(
    writer: EventWriter, firsts: list[Any], streams: list[Chunks], replies: list[Reply]
) -> AsyncIterator[str]:
    """The SSE events of n choices' streams (their first chunks already read); a client that goes away
    mid-stream cancels every one of its requests in Triton."""
    try:
        async with aclosing(_events(writer, firsts, streams, replies)) as events:
            async for ev in events:
                yield ev
    finally:
        for chunks in streams:
            await close(chunks)


async def _events(
    writer: EventWriter, firsts: list[Any], streams: list[Chunks], replies: list[Reply]
) -> AsyncIterator[str]:
    if writer.chat:
        for i in range(len(streams)):
            yield writer.role(i, firsts[i])
    canvases, sent = [0] * len(streams), [0] * len(streams)
    try:
        async with aclosing(merged(streams, firsts)) as items:
            async for i, item in items:
                draft = draft_of(item)
                if draft is not None:
                    yield writer.draft(canvases[i], *draft, index=i)
                    continue
                reply = replies[i]
                offset = len(reply.text)
                piece = reply.add(item)
                finished = bool(item.get("finish_reason"))
                if writer.plan is not None:  # tool calls: sent once the reply is complete
                    end = content_end(reply.text) if writer.streams_content and not finished else sent[i]
                    if end > sent[i]:
                        yield writer.chunk(reply.text[sent[i] : end], None, replies, i)
                        sent[i] = end
                    if finished:
                        yield writer.tool_calls(reply, replies, i, sent[i])
                    continue
                logprobs = reply.new_logprobs
                if piece:
                    canvases[i] += 1
                    yield writer.chunk(piece, None, replies, i, logprobs, offset)
                    logprobs = []
                if finished:
                    yield writer.chunk(None, reply.finish_reason, replies, i, logprobs, len(reply.text))
    except RequestError as e:  # after a 200: the error travels as an event
        yield writer.error(e)
        yield DONE
        return
    if writer.include_usage:
        yield writer.usage(replies)
    yield DONE
