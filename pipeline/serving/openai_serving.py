"""The OpenAI frontend's handler object (stored on `app.state.openai`; the routes in openai_api.py call it):
one served model, its Triton stream and API key. It checks a request (content type, JSON, OpenAI's
fields, the model name), sends the Triton inputs, and answers with the whole completion or its SSE
stream."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from pipeline.runtime.chat_template import MessagesError, parse_messages
from pipeline.serving.client import Reply
from pipeline.serving.openai_errors import validation_message
from pipeline.serving.openai_schema import ChatCompletionRequest, CompletionRequest, RequestError
from pipeline.serving.openai_sse import EventWriter, sse_events, usage
from pipeline.serving.openai_stream import END, Chunks, TritonStream, close, pull

OpenAIRequest = ChatCompletionRequest | CompletionRequest
SEED_HEADER = "x-dgpipe-seed"  # the seed a response sampled with (drawn when the request sent none)


class OpenAIServing:
    def __init__(
        self,
        stream: TritonStream,
        model: str,
        api_key: str | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.stream, self.model, self.api_key, self.ready = stream, model, api_key, ready
        self.created = int(time.time())

    def authorize(self, request: Request) -> None:
        """The Bearer key check of /v1 (no key configured: open)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise RequestError(
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                None,
                401,
                "invalid_api_key",
            )

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        if name is not None and name != self.model:
            raise RequestError(f"the model '{name}' does not exist", "model", 404, "model_not_found")
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "dgpipe"}

    async def parse(self, request: Request, cls: type[OpenAIRequest]) -> OpenAIRequest:
        """The request body as the OpenAI request `cls`, every field checked; RequestError otherwise."""
        ctype = request.headers.get("content-type")  # absent: read as JSON, as curl users expect
        media = (ctype or "application/json").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise RequestError(
                f"Content-Type '{ctype}' is not supported: send 'Content-Type: application/json'",
                None,
                415,
                "unsupported_media_type",
            )
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object (got {type(body).__name__})")
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            raise RequestError(*validation_message(e)) from e
        req.check()
        if req.model != self.model:
            raise RequestError(
                f"the model '{req.model}' does not exist (this server serves '{self.model}')",
                "model",
                404,
                "model_not_found",
            )
        return req

    async def chat_completion(self, request: Request) -> Any:
        req = await self.parse(request, ChatCompletionRequest)
        try:
            req.messages = parse_messages(req.messages)  # content parts joined into text
        except MessagesError as e:
            raise RequestError(str(e), "messages") from e
        return await self.respond(req, chat=True)

    async def completion(self, request: Request) -> Any:
        return await self.respond(await self.parse(request, CompletionRequest), chat=False)

    async def respond(self, req: OpenAIRequest, chat: bool) -> Any:
        """Send the request to Triton; the whole completion, or its SSE stream with `stream: true`, with the
        seed it sampled with in the SEED_HEADER header."""
        chunks = self.stream(req.triton_inputs())
        try:
            first = await pull(chunks)  # Triton refuses a bad value before any output
        except BaseException:
            await close(chunks)
            raise
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind + (".chunk" if req.stream and chat else ""),
            "created": int(time.time()),
            "model": self.model,
        }
        headers = {SEED_HEADER: str(req.sampler_seed)}
        if not req.stream:
            return JSONResponse(await self._whole(head, first, chunks, chat), headers=headers)
        writer = EventWriter(head, chat, req.include_usage, req.continuous_usage)
        events = sse_events(writer, first, chunks, Reply())
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _whole(self, head: dict[str, Any], first: Any, chunks: Chunks, chat: bool) -> dict[str, Any]:
        reply, item = Reply(), first
        try:
            while item is not END:
                reply.add(item)
                item = await pull(chunks)
        finally:
            await close(chunks)  # a no-op once Triton has finished; otherwise the request is dropped
        choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        return {**head, "choices": [choice], "usage": usage(reply)}
