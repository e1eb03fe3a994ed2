"""Clients for a dgpipe model on Triton: HTTP `generate` / `generate_stream` (SSE), gRPC streaming, and the
OpenAI-compatible frontend of `dgpipe serve` (`http://HOST:9000/v1`, SSE, Bearer API key).

All return the same `Reply` so `dgpipe generate --url` prints the same thing whichever protocol it uses.
Tensor names and types come from pipeline/serving/schema.py, as the server's own config.pbtxt does.
"""

from __future__ import annotations

import contextlib
import json
import queue
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline import endpoints
from pipeline.endpoints import MODEL_NAME, MODEL_NAME_ENV
from pipeline.errors import DgpipeError
from pipeline.serving import schema
from pipeline.serving.error_kinds import ErrorKind, from_wire


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def draft_of(chunk: dict[str, Any]) -> tuple[int, str] | None:
    """(step, canvas text) when the chunk is a `stream_drafts` draft, else None: the model marks a draft
    by `denoise_steps` on a response that is not the final one (schema.OUTPUTS)."""
    if chunk.get("denoise_steps") is None or chunk.get("finish_reason"):
        return None
    return int(_first(chunk["denoise_steps"])), _first(chunk.get("text_output", ""))


@dataclass
class Reply:
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    finish_reason: str = ""
    denoise_steps: list[int] = field(default_factory=list)
    num_input_tokens: int | None = None
    num_cached_tokens: int | None = None  # of the prompt's, those the prefix cache held
    num_output_tokens: int | None = None
    drafts: int = 0  # draft responses seen (never part of the text)
    # return_log_probs: every token entry so far, and those of the latest chunk
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    new_logprobs: list[dict[str, Any]] = field(default_factory=list)

    def add(self, chunk: dict[str, Any]) -> str:
        """Fold one response chunk in; returns the committed text it adds ("" for a draft)."""
        if draft_of(chunk) is not None:
            self.drafts += 1
            return ""
        piece = _first(chunk.get("text_output", ""))
        raw = chunk.get("logprobs")
        self.new_logprobs = json.loads(_first(raw)) if raw else []
        self.logprobs += self.new_logprobs
        if chunk.get("finish_reason"):
            fr = chunk["finish_reason"]
            self.finish_reason = fr[0] if isinstance(fr, list) else fr
            steps = chunk.get("denoise_steps")
            self.denoise_steps = (
                list(steps) if isinstance(steps, list) else ([steps] if steps is not None else [])
            )
        for key in ("num_input_tokens", "num_cached_tokens", "num_output_tokens"):
            if chunk.get(key) is not None:
                v = chunk[key]
                setattr(self, key, int(v[0] if isinstance(v, list) else v))
        if piece:
            self.pieces.append(piece)
            self.text += piece
        return piece


class TritonError(DgpipeError):
    """The server refused or failed the request; `kind` says how (its HTTP status: `status`), the message
    is the server's, without the kind's wire tag."""

    def __init__(
        self, message: str, kind: ErrorKind = ErrorKind.INVALID_REQUEST, hint: str | None = None
    ) -> None:
        super().__init__(message, hint)
        self.kind = kind

    @property
    def status(self) -> int:
        return self.kind.status


def unknown_model_hint(model: str) -> str:
    """What to do when the server serves no model of the name asked for (HTTP 404; over gRPC, a model
    Triton does not report ready)."""
    return (
        f"this server serves no model '{model}': ask for the one it serves with --name NAME "
        f"(or ${MODEL_NAME_ENV})"
    )


def model_error(
    message: str, untagged: ErrorKind = ErrorKind.INVALID_REQUEST, prefix: str = ""
) -> TritonError:
    """The model's error message (its kind tagged on the wire) as a TritonError; `untagged`: the kind of an
    error that carries no tag (one of Triton's own)."""
    kind, text = from_wire(message, untagged)
    return TritonError(prefix + text, kind)


def http_generate(
    url: str, body: dict[str, Any], model: str = MODEL_NAME, timeout: float = 600
) -> Iterator[dict[str, Any]]:
    """POST to generate_stream (SSE) and yield each event's JSON; errors become TritonError."""
    req = urllib.request.Request(
        f"{url.rstrip('/')}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise model_error(event["error"])
                yield event
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip().removeprefix("data:").strip()
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            detail = json.loads(detail).get("error", detail)
        err = model_error(str(detail), ErrorKind.from_status(e.code), f"HTTP {e.code}: ")
        err.hint = unknown_model_hint(model) if e.code == 404 else None
        raise err from e
    except urllib.error.URLError as e:
        raise DgpipeError(
            f"cannot reach {url} ({e.reason})", "is the server running? see dgpipe serve"
        ) from e


def _grpc_inputs(body: dict[str, Any]) -> list:
    """The request's InferInputs, typed by the schema."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in body.items():
        # a name outside the schema is sent as it is, typed by its value, for the server to refuse
        arr = schema.input_array(name, value) if name in schema.INPUT else _untyped_array(value)
        t = grpcclient.InferInput(
            name, list(arr.shape), "BYTES" if arr.dtype == np.object_ else np_to_triton_dtype(arr.dtype)
        )
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _grpc_chunk(result) -> dict[str, Any]:
    """One gRPC response as the dict every client yields (lists of values, text decoded)."""
    chunk: dict[str, Any] = {}
    for out in result.get_response().outputs:
        arr = result.as_numpy(out.name)
        chunk[out.name] = [x.decode() if isinstance(x, bytes) else x.item() for x in arr.reshape(-1)]
    return chunk


def _grpc_error(url: str, message: str, unavailable: bool) -> DgpipeError:
    if unavailable:  # the stream's channel failed
        return DgpipeError(f"cannot reach {url} ({message})", "is the server running? see dgpipe serve")
    return model_error(message)


def _model_ready(client, model: str) -> bool:
    """Triton's model-ready call (open under the API lock-down); False when it fails too."""
    try:
        return bool(client.is_model_ready(model))
    except Exception:
        return False


def grpc_generate(
    url: str, body: dict[str, Any], model: str = MODEL_NAME, timeout: float = 600
) -> Iterator[dict[str, Any]]:
    """gRPC bidirectional streaming (ModelStreamInfer), yielding the same dicts as the HTTP client.
    Closing the generator early or a failure cancels the request in Triton (the model drops it at its
    next step) instead of waiting for it to finish."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = _grpc_inputs(body)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    finished = False
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                message = error.message() if hasattr(error, "message") else str(error)
                status = str(getattr(error, "status", lambda: "")())
                err = _grpc_error(url, message, "UNAVAILABLE" in status)
                # a stream's errors carry no status code: ask Triton whether the model is there at all
                if err.hint is None and not _model_ready(client, model):
                    err.hint = unknown_model_hint(model)
                raise err
            chunk = _grpc_chunk(result)
            if chunk:
                yield chunk
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                finished = True
                return
    except InferenceServerException as e:
        raise DgpipeError(
            f"cannot reach {url} ({e.message()})", "is the server running? see dgpipe serve"
        ) from e
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


class AsyncTriton:
    """gRPC streaming on asyncio for a server that asks Triton many requests at once (the OpenAI frontend):
    one channel for every request, each request its own ModelStreamInfer call, no threads. Use it inside
    one event loop (the channel is created on first use, in the running loop); `aclose` at the end."""

    def __init__(self, url: str, timeout: float = 600) -> None:
        self.url, self.timeout = url, timeout
        self._client = None

    async def stream(self, model: str, body: dict[str, Any]):
        """Yield the response chunks of one request to `model` (grpc_generate's dicts). It ends after the response
        with `finish_reason` (the model's last, schema.OUTPUTS); closing the generator before that, or a
        failure, cancels the gRPC call, and Triton cancels the request (the model drops it)."""
        import grpc
        import tritonclient.grpc.aio as grpcaio

        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url.removeprefix("grpc://"))
        request = {"model_name": model, "inputs": _grpc_inputs(body)}

        async def one():
            yield request

        call = self._client.stream_infer(one(), stream_timeout=self.timeout)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise _grpc_error(self.url, error.message(), False)
                chunk = _grpc_chunk(result)
                if chunk:
                    yield chunk
                finished = bool(chunk.get("finish_reason"))
                if finished:
                    break
            if finished:  # let Triton end the call (it does once the final response is out): never cancel
                async for _ in call:  # a finished request, which can leave it holding the request
                    pass
        except grpc.RpcError as e:  # the call itself failed: Triton gone, or a deadline
            unavailable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            raise _grpc_error(self.url, e.details() or str(e.code()), unavailable) from e
        finally:
            if not finished:
                call.cancel()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


OPENAI_FIELDS = (
    "max_tokens",
    "seed",
    "max_denoising_steps",
    "entropy_bound",
    "confidence_threshold",
    "t_min",
    "t_max",
    "stream_drafts",
)
OPENAI_IMPLIED = ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens")


def openai_guide(kind: str, guide: str) -> dict[str, Any]:
    """A Triton guide as the OpenAI request's field: response_format for JSON, vLLM's `structured_outputs`
    otherwise (`openai_schema.STRUCTURED_OUTPUTS`)."""
    if kind == "json":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {"name": "output", "schema": json.loads(guide)}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    if kind == "choice":
        return {"structured_outputs": {"choice": json.loads(guide)}}
    if kind == "lark_grammar":
        return {"structured_outputs": {"grammar": guide}}
    return {"structured_outputs": {"regex": guide}}


def openai_body(body: dict[str, Any], model: str = MODEL_NAME) -> tuple[str, dict[str, Any]]:
    """A Triton request body as (path, OpenAI request) for the frontend: `messages` to chat completions,
    `text_input` to completions; always streamed with usage. Inputs the frontend has no field for are refused."""
    unsupported = sorted(
        set(body)
        - {"text_input", "messages", "stop_words", *schema.GUIDE_INPUTS, *OPENAI_FIELDS, *OPENAI_IMPLIED}
    )
    if unsupported:
        raise DgpipeError(
            f"{', '.join(unsupported)}: not available through the OpenAI API",
            f"use the Triton ports (http://HOST:{endpoints.HTTP_PORT} or grpc://HOST:{endpoints.GRPC_PORT})",
        )
    req: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    req.update({k: body[k] for k in OPENAI_FIELDS if body.get(k) is not None})
    if body.get("stop_words"):
        req["stop"] = list(body["stop_words"])
    if body.get("guided_decoding_guide_type") is not None:
        req.update(openai_guide(body["guided_decoding_guide_type"], body.get("guided_decoding_guide") or ""))
    if "messages" in body:
        return "/chat/completions", {**req, "messages": json.loads(body["messages"])}
    return "/completions", {**req, "prompt": body["text_input"]}


def openai_generate(
    url: str, body: dict[str, Any], model: str = MODEL_NAME, api_key: str | None = None, timeout: float = 600
) -> Iterator[dict[str, Any]]:
    """Stream from the OpenAI-compatible frontend, yielding the same dicts as the Triton clients."""
    path, req_body = openai_body(body, model)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(req_body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    error = event["error"]
                    kind = ErrorKind.from_code(error.get("code"), 400)
                    raise TritonError(error.get("message", str(error)), kind)
                if event.get("object") == "dgpipe.draft":  # back to the model's own draft response
                    draft = event["dgpipe"]
                    yield {"text_output": draft["text"], "denoise_steps": [draft["step"]]}
                    continue
                for choice in event.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        yield {"text_output": piece}
                    if choice.get("finish_reason"):
                        yield {"finish_reason": choice["finish_reason"]}
                if event.get("usage"):
                    usage = event["usage"]
                    yield {
                        "num_input_tokens": usage["prompt_tokens"],
                        "num_cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                        "num_output_tokens": usage["completion_tokens"],
                    }
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip()
        with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
            detail = json.loads(detail)["error"]["message"]
        hint = "pass --api-key or set DGPIPE_API_KEY" if e.code == 401 else None
        if hint:
            raise DgpipeError(f"HTTP 401: {detail}", hint) from e
        hint = unknown_model_hint(model) if e.code == 404 else None
        raise TritonError(f"HTTP {e.code}: {detail}", ErrorKind.from_status(e.code), hint) from e
    except urllib.error.URLError as e:
        raise DgpipeError(
            f"cannot reach {url} ({e.reason})", "is the server running? see dgpipe serve"
        ) from e


def _untyped_array(value: Any):
    import numpy as np

    if isinstance(value, str):
        return np.array([value.encode()], dtype=np.object_)
    if isinstance(value, bool):
        return np.array([value], dtype=np.bool_)
    if isinstance(value, list):
        return np.array([str(v).encode() for v in value], dtype=np.object_)
    return np.array([value], dtype=np.float32)


def generate(
    url: str,
    prompt: str | None,
    max_tokens: int = schema.INPUT["max_tokens"].default,
    stream: bool = False,
    seed: int = schema.INPUT["seed"].default,
    model: str = MODEL_NAME,
    messages: list[dict[str, Any]] | None = None,
    api_key: str | None = None,
    on_draft: Callable[[int, str], None] | None = None,
    **options: Any,
) -> Iterator[str]:
    """Yield text pieces as the server sends them; the final Reply is the generator's return value.
    With `messages` (OpenAI-style chat messages) and prompt None, the server renders its chat template.
    A URL ending in /v1 is the OpenAI-compatible frontend (`api_key`: its Bearer key). `on_draft(step, text)`
    sees each draft of a `stream_drafts` request (drafts are never part of the text)."""
    if messages is not None:
        options = {**options, "messages": json.dumps(messages)}
    body = schema.request_body(prompt, max_tokens, stream, seed, options)
    if url.startswith("grpc://"):
        chunks = grpc_generate(url, body, model)
    elif url.startswith(("http://", "https://")) and url.rstrip("/").endswith("/v1"):
        chunks = openai_generate(url, body, model, api_key)
    elif url.startswith(("http://", "https://")):
        chunks = http_generate(url, body, model)
    else:
        raise DgpipeError(f"--url {url}: expected http://HOST:PORT, grpc://HOST:PORT or http://HOST:PORT/v1")
    reply = Reply()
    for chunk in chunks:
        if on_draft is not None and (draft := draft_of(chunk)) is not None:
            on_draft(*draft)
        piece = reply.add(chunk)
        if piece:
            yield piece
    return reply


def complete(url: str, prompt: str, **kw: Any) -> Reply:
    """The whole reply at once (streams under the hood when stream=True)."""
    gen = generate(url, prompt, **kw)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value
