"""The OpenAI-compatible HTTP frontend (FastAPI) in front of the dgpipe Triton model.

`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`, built like Triton's own OpenAI
frontend but talking to a running tritonserver over gRPC streaming (pipeline/serving/client.py) with our
tensor names: chat `messages` go to the `messages` input as JSON (the model renders its chat template), a
`prompt` to `text_input`. What each OpenAI field means here is in pipeline/serving/openai_schema.py.

Every error is OpenAI's schema, `{"error": {"message", "type", "param", "code"}}`: a refused field or
malformed JSON is a 400 (never FastAPI's 422), a value the Triton model refuses is a 400 with its message,
a missing or wrong API key a 401, an unknown model a 404, Triton unreachable a 503. `stream: true` answers
server-sent events, one chunk per committed canvas, then `data: [DONE]`. Library code: nothing is printed.

Drafts (`stream_drafts: true`, only when asked): the canvas after every denoise step travels as its own
event, `event: dgpipe.draft` with `{"object": "dgpipe.draft", "choices": [], "dgpipe": {"canvas", "step",
"text"}}`, beside the standard chunks, which stay exactly what they are without drafts. An SSE reader tells
them apart by the event name; openai-python (3.57, the tests' client) yields them as chunks whose `object`
is "dgpipe.draft" and whose `choices` is empty (1.x releases wrap named events as {"data", "event"}: read
drafts with a plain SSE reader there).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.endpoints import MODEL_NAME
from pipeline.errors import DgpipeError
from pipeline.runtime.chat_template import MessagesError, parse_messages
from pipeline.serving.client import AsyncTriton, Reply, TritonError, draft_of
from pipeline.serving.openai_schema import ChatCompletionRequest, CompletionRequest, RequestError
from pipeline.serving.schema import DRAINING

# Triton inputs (schema names) -> the model's response chunks (client.grpc_generate's dicts); closing the
# generator before its end cancels the request in Triton
TritonStream = Callable[[dict[str, Any]], AsyncGenerator[dict[str, Any], None]]
_END = object()


def triton_stream(grpc_url: str, model: str = MODEL_NAME) -> TritonStream:
    """The production backend: gRPC streaming on the event loop (client.AsyncTriton: one channel, no
    threads). Its `aclose` runs at the app's shutdown."""
    return AsyncTriton(grpc_url, model).stream


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _from_triton(e: Exception) -> RequestError:
    """A failure talking to Triton as the frontend's error: its 400 stays a 400, a draining model or
    unreachable Triton is a 503, a request past its deadline a 504."""
    if isinstance(e, TritonError):
        status = e.status if e.status in (400, 500, 503, 504) else 500
        code = {400: None, 503: "service_unavailable", 504: "timeout"}.get(status, "triton_error")
        return RequestError(str(e), None, status, code)
    return RequestError(f"the model server is unavailable: {e}", None, 503, "service_unavailable")


async def _pull(chunks: AsyncGenerator[dict[str, Any], None]) -> Any:
    """The next chunk, _END at the end; Triton failures as RequestError."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return _END
    except (TritonError, DgpipeError) as e:
        raise _from_triton(e) from e


async def _close(chunks: AsyncGenerator[dict[str, Any], None]) -> None:
    """End the Triton stream (cancelling the request if it is still running), even from a cancelled task
    (the client went away): shielded, so the cleanup itself is not cancelled."""
    with anyio.CancelScope(shield=True):
        await chunks.aclose()


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first problem as (message, param): the param is the top-level field (the full path is in the
    message; a union's path also names the member type pydantic tried)."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field '{where}' (this server does not support it)", param
    if err["type"] == "missing":
        return f"'{where}' is required", param
    return f"'{where}': {err['msg']}", param


def _usage(reply: Reply) -> dict[str, int]:
    prompt, completion = reply.num_input_tokens or 0, reply.num_output_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Admission:
    """The /v1 requests in flight (a stream until its last event) and whether the frontend drains: then
    new ones are answered 503 while those in flight finish (`dgpipe serve` drains on SIGTERM with it)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False

    def drain(self) -> None:
        self.draining = True


class _Admit:
    """ASGI middleware applying an Admission (pure ASGI, so a stream counts until its last byte)."""

    def __init__(self, app, admission: Admission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            body = json.dumps(
                error_body(
                    DRAINING,
                    "server_error",
                    code="service_unavailable",
                )
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.admission.inflight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.inflight -= 1


def create_app(
    stream: TritonStream,
    model: str = MODEL_NAME,
    api_key: str | None = None,
    ready: Callable[[], bool] | None = None,
    admission: Admission | None = None,
) -> FastAPI:
    """The frontend for one served model. `stream` sends Triton inputs and yields response chunks (tests
    pass a fake); `api_key` (None: open) guards /v1; `ready` (None: always) decides /health, which also
    answers 503 while `admission` (the caller's, or app.state.admission) drains."""
    created = int(time.time())
    backend = getattr(stream, "__self__", None)  # AsyncTriton when `stream` is its bound method

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if isinstance(backend, AsyncTriton):
            await backend.aclose()

    app = FastAPI(
        title="dgpipe OpenAI-compatible API",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.admission = admission = admission or Admission()
    app.add_middleware(_Admit, admission=admission)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        return _error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(400, f"invalid request: {e.errors()[0].get('msg', e)}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        # a bug of ours, still in OpenAI's schema (uvicorn logs the traceback); the server keeps serving
        return _error_response(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(
            e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None
        )

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError(
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                None,
                401,
                "invalid_api_key",
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = not admission.draining and (True if ready is None else await run_in_threadpool(ready))
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def model_card() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "dgpipe"}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name}")
    async def one_model(name: str) -> dict[str, Any]:
        if name != model:
            raise RequestError(f"the model '{name}' does not exist", "model", 404, "model_not_found")
        return model_card()

    async def parse(request: Request, cls: type[ChatCompletionRequest] | type[CompletionRequest]):
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
            message, param = _validation_message(e)
            raise RequestError(message, param) from e
        req.check()
        if req.model != model:
            raise RequestError(
                f"the model '{req.model}' does not exist (this server serves '{model}')",
                "model",
                404,
                "model_not_found",
            )
        return req

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatCompletionRequest)
        try:
            parse_messages(req.messages)
        except MessagesError as e:
            raise RequestError(str(e), "messages") from e
        return await respond(req, req.triton_inputs(), chat=True)

    @v1.post("/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        return await respond(req, req.triton_inputs(), chat=False)

    async def respond(req, inputs: dict[str, Any], chat: bool):
        chunks = stream(inputs)
        try:
            first = await _pull(chunks)  # Triton refuses a bad value before any output
        except BaseException:
            await _close(chunks)
            raise
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {
            "id": ident,
            "object": ("chat.completion" if chat else "text_completion")
            + (".chunk" if req.stream and chat else ""),
            "created": int(time.time()),
            "model": model,
        }
        reply = Reply()
        if not req.stream:
            item = first
            try:
                while item is not _END:
                    reply.add(item)
                    item = await _pull(chunks)
            finally:
                await _close(chunks)  # a no-op once Triton has finished; otherwise the request is dropped
            choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": reply.text}
            else:
                choice["text"] = reply.text
            return {**head, "choices": [choice], "usage": _usage(reply)}
        return StreamingResponse(
            _events(head, first, chunks, reply, chat, req.include_usage),
            media_type="text/event-stream",
        )

    async def _events(
        head: dict,
        first: Any,
        chunks: AsyncGenerator,
        reply: Reply,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """The SSE events; a client that goes away mid-stream cancels its request in Triton."""
        try:
            async for ev in _sse(head, first, chunks, reply, chat, include_usage):
                yield ev
        finally:
            await _close(chunks)

    async def _sse(
        head: dict, first: Any, chunks: AsyncGenerator, reply: Reply, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}

        def event(payload: dict[str, Any]) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(piece: str | None, finish: str | None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {} if piece is None else {"content": piece}
            else:
                choice["text"] = piece or ""
            return event({**head, "choices": [choice], **extra})

        def draft_event(canvas: int, step: int, text: str) -> str:
            payload = {**head, "object": "dgpipe.draft", "choices": []}
            payload["dgpipe"] = {"canvas": canvas, "step": step, "text": text}
            return f"event: dgpipe.draft\n{event(payload)}"

        if chat:
            yield event(
                {
                    **head,
                    "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    ],
                    **extra,
                }
            )
        item, canvases = first, 0
        try:
            while item is not _END:
                draft = draft_of(item)
                if draft is not None:
                    yield draft_event(canvases, *draft)
                    item = await _pull(chunks)
                    continue
                piece = reply.add(item)
                if piece:
                    canvases += 1
                    yield chunk(piece, None)
                if item.get("finish_reason"):
                    yield chunk(None, reply.finish_reason)
                item = await _pull(chunks)
        except RequestError as e:  # after a 200: the error travels as an event, as OpenAI's servers do
            yield event(error_body(e.message, "server_error" if e.status >= 500 else "invalid_request_error"))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield event({**head, "choices": [], "usage": _usage(reply)})
        yield "data: [DONE]\n\n"

    app.include_router(v1)
    return app
