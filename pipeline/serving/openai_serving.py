"""The OpenAI frontend's handler object (stored on `app.state.openai`; the routes in openai_api.py call it):
one served model, its Triton stream and API key. It checks a request (content type, JSON, OpenAI's
fields, the model name), sends the Triton inputs, and answers with the whole completion or its SSE
stream. A request is bounded before anything costly: its body by size (413), its prompt by UTF-8 bytes
and its text by being valid Unicode (400), before any template or tokenizer sees it."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from pipeline.errors import InputError
from pipeline.limits import DEFAULTS, request_bytes_limit
from pipeline.runtime.chat_template import MessagesError, parse_messages
from pipeline.sampler.guide_size import check_guide_size
from pipeline.serving.client import Reply
from pipeline.serving.openai_choices import whole_choice
from pipeline.serving.openai_errors import error_body, validation_message
from pipeline.serving.openai_schema import ChatCompletionRequest, CompletionRequest, RequestError
from pipeline.serving.openai_sse import EventWriter, sse_events, usage
from pipeline.serving.openai_stream import END, Chunks, TritonStream, close, pull
from pipeline.serving.openai_tools import request_plan, tool_inputs
from pipeline.serving.schema import TextError, prompt_too_big, text_bytes

OpenAIRequest = ChatCompletionRequest | CompletionRequest
PROMPT_FIELDS = ("prompt", "messages")  # what max_prompt_bytes bounds in an OpenAI request
# what the guide size limits bound (sampler.guide_size), checked on the raw body before anything compiles
GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# a body over the limit is still read (and dropped) up to this many times it, so its client reads the 413
DISCARD_FACTOR = 4
CLIENT_CLOSED = 499  # the status logged for a request whose client left (nobody reads the response)
SEED_HEADER = "x-dgpipe-seed"  # the seed a response sampled with (drawn when the request sent none)
CHOICE_SEEDS_HEADER = "x-dgpipe-choice-seeds"  # with n > 1: each choice's seed, comma-separated, in order


class OpenAIServing:
    def __init__(
        self,
        stream: TritonStream,
        model: str | None,
        api_key: str | None = None,
        ready: Callable[[], bool] | None = None,
        max_prompt_bytes: int = DEFAULTS.max_prompt_bytes,
        max_guide_bytes: int = DEFAULTS.max_guide_bytes,
        max_regex_positions: int = DEFAULTS.max_regex_positions,
    ) -> None:
        self.stream, self.model, self.api_key, self.ready = stream, model, api_key, ready
        self.max_prompt_bytes = max_prompt_bytes
        # the served repository's guide size limits, checked here too: an oversized guide goes no further
        self.max_guide_bytes, self.max_regex_positions = max_guide_bytes, max_regex_positions
        self.created = int(time.time())

    def serve(self, name: str, max_prompt_bytes: int, max_guide_bytes: int, max_regex_positions: int) -> None:
        """The served model, once known (a sidecar learns it from Triton after it starts): its name, for
        the requests, the models list and the Triton requests, and its repository's limits."""
        self.max_prompt_bytes, self.max_guide_bytes, self.max_regex_positions = (
            max_prompt_bytes,
            max_guide_bytes,
            max_regex_positions,
        )
        self.model = name

    def served_model(self) -> str:
        """The served model's name; 503 while it is not known yet (Triton loading or unreachable)."""
        if self.model is None:
            raise RequestError(
                "no model is ready behind this frontend yet (Triton is loading it, or unreachable)",
                None,
                503,
                "service_unavailable",
            )
        return self.model

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
        model = self.served_model()
        if name is not None and name != model:
            raise RequestError(f"the model '{name}' does not exist", "model", 404, "model_not_found")
        return {"id": model, "object": "model", "created": self.created, "owned_by": "dgpipe"}

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
        raw = await self.body(request)  # its size refused as a 413, before any parsing
        try:
            body = json.loads(raw)
        except ValueError as e:  # malformed, not UTF-8, or a number past Python's 4300-digit conversion limit
            raise RequestError(f"the request body is not valid JSON: {e}") from e
        except RecursionError as e:
            raise RequestError(
                "the request body nests arrays or objects deeper than JSON parsing allows"
            ) from e
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object (got {type(body).__name__})")
        self.check_text(body)
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            raise RequestError(*validation_message(e)) from e
        req.check()
        if req.model != self.served_model():
            raise RequestError(
                f"the model '{req.model}' does not exist (this server serves '{self.model}')",
                "model",
                404,
                "model_not_found",
            )
        return req

    async def body(self, request: Request) -> bytes:
        """The request body, kept no further than `request_bytes_limit` (413 past it). A body over it is
        read to its end and dropped (a client still sending would otherwise see its connection reset, not
        the 413), up to DISCARD_FACTOR times the limit; one announced as bigger is refused unread."""
        limit = request_bytes_limit(self.max_prompt_bytes)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > DISCARD_FACTOR * limit:
            raise _too_large(f"{declared} bytes", limit)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > DISCARD_FACTOR * limit:
                break
            if size <= limit:
                parts.append(part)
        if size > limit:
            raise _too_large(f"{declared} bytes" if declared.isdigit() else f"more than {limit} bytes", limit)
        return b"".join(parts)

    def check_text(self, body: dict[str, Any]) -> None:
        """Every string of the body valid Unicode (JSON's \\uD800 escape carries a lone surrogate, which
        cannot be sent on as UTF-8), and the prompt within max_prompt_bytes: 400s naming the field."""
        for key, value in body.items():
            try:
                size = text_bytes(value, f"'{key}'")
            except TextError as e:
                raise RequestError(str(e), str(key)) from e
            if key in PROMPT_FIELDS and size > self.max_prompt_bytes:
                raise RequestError(prompt_too_big(f"'{key}'", size, self.max_prompt_bytes, "text "), key)
            guides = [(key, key == "guided_regex", value)] if key in GUIDE_FIELDS else []
            if key == "structured_outputs" and isinstance(value, dict):
                guides = [(f"{key}.{k}", k == "regex", v) for k, v in value.items()]
            for param, regex, guide in guides:  # before the guide is parsed or checked
                if guide is None or isinstance(guide, bool):
                    continue
                text = guide if isinstance(guide, str) else json.dumps(guide)
                kind = "regex" if regex else "guide"
                try:
                    check_guide_size(kind, text, self.max_guide_bytes, self.max_regex_positions, f"'{param}'")
                except InputError as e:
                    raise RequestError(str(e), param) from e

    async def chat_completion(self, request: Request) -> Any:
        req = await self.parse(request, ChatCompletionRequest)
        try:
            req.messages = parse_messages(req.messages)  # content parts joined into text
        except MessagesError as e:
            raise RequestError(str(e), "messages") from e
        return await self.respond(req, chat=True, request=request)

    async def completion(self, request: Request) -> Any:
        return await self.respond(await self.parse(request, CompletionRequest), chat=False, request=request)

    async def respond(self, req: OpenAIRequest, chat: bool, request: Request | None = None) -> Any:
        """Send the request to Triton; the whole completion, or its SSE stream with `stream: true`, with the
        seed it sampled with in the SEED_HEADER header."""
        kind = "chat.completion" if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind + (".chunk" if req.stream and chat else ""),
            "created": int(time.time()),
            "model": self.model,
        }
        headers = {SEED_HEADER: str(req.sampler_seed)}
        if req.n > 1:
            headers[CHOICE_SEEDS_HEADER] = ",".join(map(str, req.choice_seeds()))
        plan = request_plan(req) if isinstance(req, ChatCompletionRequest) else None
        inputs = {**req.triton_inputs(), **tool_inputs(plan)}
        # n choices: n requests with the derived seeds, sent together so they share the batch's passes
        streams = [self.stream(self.model, {**inputs, "seed": seed}) for seed in req.choice_seeds()]
        logprobs = req.top_logprobs_wanted() is not None
        if not req.stream:
            whole = await self._whole(head, streams, chat, request)
            if isinstance(whole, JSONResponse):
                return whole
            choices = [whole_choice(i, r, chat, logprobs, plan) for i, r in enumerate(whole)]
            body = {**head, "choices": choices, "usage": usage(whole)}
            return JSONResponse(body, headers=headers)
        firsts: list[Any] = [END] * len(streams)

        async def first(i: int) -> None:  # Triton refuses a bad value before any output
            firsts[i] = await pull(streams[i])

        # the first chunk waits for a batch slot and a whole canvas: a client that leaves meanwhile cancels
        left = await self._watched(streams, request, first)
        if left is not None:
            return left
        writer = EventWriter(head, chat, req.include_usage, req.continuous_usage, logprobs, plan)
        events = sse_events(writer, firsts, streams, [Reply() for _ in streams])
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _whole(
        self, head: dict[str, Any], streams: list[Chunks], chat: bool, request: Request | None
    ) -> list[Reply] | JSONResponse:
        """Every choice's whole reply; a client that leaves before they are done cancels the requests in
        Triton (closing the streams, as a streamed response does) instead of leaving them to run."""
        replies = [Reply() for _ in streams]

        async def collect(i: int) -> None:
            while (item := await pull(streams[i])) is not END:
                replies[i].add(item)

        try:
            left = await self._watched(streams, request, collect)
        finally:
            for chunks in streams:  # a no-op once Triton has finished; otherwise the request is dropped
                await close(chunks)
        return replies if left is None else left

    async def _watched(
        self, streams: list[Chunks], request: Request | None, work: Callable[[int], Any]
    ) -> JSONResponse | None:
        """`work(i)` for every stream while the client's connection is watched; the 499 response when the
        client left first (the streams then closed: their requests cancelled in Triton), else None. A
        failure of `work` closes every stream and is raised."""
        left, failure = False, None

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal left
            assert request is not None
            while (await request.receive())["type"] != "http.disconnect":
                await anyio.sleep(0.05)  # body already read: nothing else is expected before it
            left = True
            scope.cancel()

        async def run(i: int, scope: anyio.CancelScope) -> None:
            nonlocal failure
            try:
                await work(i)
            except Exception as e:  # kept, not raised in the group (not as an ExceptionGroup)
                failure = failure or e
                scope.cancel()

        try:
            async with anyio.create_task_group() as tasks:
                if request is not None:
                    tasks.start_soon(watch, tasks.cancel_scope)
                async with anyio.create_task_group() as each:
                    for i in range(len(streams)):
                        each.start_soon(run, i, tasks.cancel_scope)
                tasks.cancel_scope.cancel()
        except BaseException:
            for chunks in streams:
                await close(chunks)
            raise
        if failure is not None or left:
            for chunks in streams:
                await close(chunks)
        if failure is not None:
            raise failure
        if left:
            return JSONResponse(
                error_body("the client closed the request", code="client_closed"), CLIENT_CLOSED
            )
        return None


def _too_large(size: str, limit: int) -> RequestError:
    return RequestError(
        f"the request body is {size}, over this server's limit of {limit} bytes (a prompt of at most "
        "max_prompt_bytes and the request's other fields): send a shorter prompt",
        None,
        413,
        "request_too_large",
    )
