"""The OpenAI-compatible HTTP frontend (FastAPI) in front of the dgpipe Triton model.

`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`, as FastAPI routers whose handlers
call the handler object on `app.state.openai` (pipeline/serving/openai_serving.py), built like Triton's own
OpenAI frontend but talking to a running tritonserver over gRPC streaming (pipeline/serving/client.py) with our
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

import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from pipeline.endpoints import MODEL_NAME
from pipeline.limits import DEFAULTS
from pipeline.serving.client import AsyncTriton
from pipeline.serving.error_kinds import ErrorKind
from pipeline.serving.openai_errors import error_body, install_error_handlers
from pipeline.serving.openai_serving import OpenAIServing
from pipeline.serving.openai_stream import TritonStream, triton_stream
from pipeline.serving.schema import DRAINING

__all__ = ["Admission", "create_app", "triton_stream"]


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
            await _refuse_draining(send)
            return
        self.admission.inflight += 1  # one event loop: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.inflight -= 1


async def _refuse_draining(send) -> None:
    unavailable = ErrorKind.UNAVAILABLE
    body = json.dumps(error_body(DRAINING, "server_error", code=unavailable.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
    await send({"type": "http.response.start", "status": unavailable.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.openai


def _authorize(request: Request) -> None:
    _serving(request).authorize(request)


router = APIRouter()  # open: the probes' /health
v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorize)])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the model answers (`ready`) and the frontend is not draining, else 503."""
    ready = _serving(request).ready
    ok = not request.app.state.admission.draining and (
        True if ready is None else await run_in_threadpool(ready)
    )
    return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)


@v1.get("/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_serving(request).model_card()]}


@v1.get("/models/{name}")
async def one_model(request: Request, name: str) -> dict[str, Any]:
    return _serving(request).model_card(name)


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    return await _serving(request).chat_completion(request)


@v1.post("/completions")
async def completions(request: Request):
    return await _serving(request).completion(request)


def create_app(
    stream: TritonStream,
    model: str = MODEL_NAME,
    api_key: str | None = None,
    ready: Callable[[], bool] | None = None,
    admission: Admission | None = None,
    max_prompt_bytes: int = DEFAULTS.max_prompt_bytes,
    guide_limits: tuple[int, int] = (DEFAULTS.max_guide_bytes, DEFAULTS.max_regex_positions),
) -> FastAPI:
    """The frontend for one served model. `stream` sends Triton inputs and yields response chunks (tests
        pass a fake); `api_key` (None: open) guards /v1; `ready` (None: always) decides /health, which also
        answers 503 while `admission` (the caller's, or app.state.admission) drains; `max_prompt_bytes` bounds
    a prompt (and so the body) before it is parsed further (the served repository's limit)."""
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
    app.state.openai = OpenAIServing(stream, model, api_key, ready, max_prompt_bytes, *guide_limits)
    app.state.admission = admission = admission or Admission()
    app.add_middleware(_Admit, admission=admission)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(v1)
    return app
