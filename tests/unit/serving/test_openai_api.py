"""The OpenAI frontend against a fake Triton stream: how requests map onto Triton inputs, the response and
SSE shapes, and OpenAI's error schema for every refusal."""

from __future__ import annotations

import json
import threading
import time

import anyio
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from pipeline.errors import DgpipeError
from pipeline.model.config import SAMPLER_RANGES
from pipeline.serving.client import TritonError
from pipeline.serving.error_kinds import ErrorKind
from pipeline.serving.openai_api import create_app
from pipeline.serving.openai_schema import temperature_range

CHAT = {"model": "dgpipe", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "dgpipe", "prompt": "hi"}
FINAL = {"text_output": [""], "finish_reason": ["stop"], "num_input_tokens": [5], "num_output_tokens": [4]}


class FakeTriton:
    """Records the inputs of each request and answers with canned chunks (or raises)."""

    def __init__(self, chunks=None, error: Exception | None = None, error_after: int = 0):
        self.chunks = (
            chunks if chunks is not None else [{"text_output": ["12"]}, {"text_output": ["34"]}, FINAL]
        )
        self.error, self.error_after = error, error_after
        self.calls: list[dict] = []

    async def __call__(self, model, inputs):
        self.calls.append(inputs)
        for i, chunk in enumerate(self.chunks):
            if self.error is not None and i == self.error_after:
                raise self.error
            yield chunk


def client(fake=None, **kw) -> tuple[TestClient, FakeTriton]:
    fake = fake or FakeTriton()
    return TestClient(create_app(fake, **kw)), fake


def assert_error(r, status: int, param=None, code=None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == param and err["code"] == code and contains in err["message"]
    return err


def sse(r) -> list:
    events = [ln[len("data: ") :] for ln in r.text.split("\n\n") if ln]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- request mapping -------------------------------------------------------------------------------------


def completion_scope() -> dict:
    """The ASGI scope of a JSON POST to /v1/completions (for tests that drive the app's receive/send)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "scheme": "http",
        "root_path": "",
    }


def test_chat_maps_messages_and_fields_onto_triton_inputs():
    c, fake = client()
    body = {
        **CHAT,
        "max_completion_tokens": 82,
        "stop": "\n",
        "seed": 7,
        "temperature": 0.6,
        "max_denoising_steps": 12,
        "entropy_bound": 0.2,
        "confidence_threshold": 0.01,
        "user": "someone",
    }
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    (inputs,) = fake.calls
    assert json.loads(inputs.pop("messages")) == CHAT["messages"]
    assert inputs == {
        "max_tokens": 82,
        "seed": 7,
        "stream": False,
        "stop_words": ["\n"],
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "max_denoising_steps": 12,
        "entropy_bound": 0.2,
        "confidence_threshold": 0.01,
        "t_min": 0.3,
        "t_max": 0.6,
    }


def test_completion_sends_the_prompt_as_text_input_and_leaves_defaults_to_the_model():
    c, fake = client()
    r = c.post("/v1/completions", json={**TEXT, "prompt": ["hi"], "max_tokens": 9})
    assert r.status_code == 200
    seed = fake.calls[0].pop("seed")  # drawn for it: the request sent none
    assert 0 <= seed < 2**63 and r.headers["x-dgpipe-seed"] == str(seed)
    assert fake.calls == [
        {
            "text_input": "hi",
            "max_tokens": 9,
            "stream": False,
            "exclude_input_in_output": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
        }
    ]


def test_temperature_maps_onto_the_schedule_clamped_and_explicit_knobs_win():
    lo = SAMPLER_RANGES["t_min"][0]
    assert temperature_range(0.8) == (0.4, 0.8)  # the published defaults
    assert temperature_range(0.0) == (lo, SAMPLER_RANGES["t_max"][0])
    c, fake = client()
    c.post("/v1/completions", json={**TEXT, "temperature": 1.0, "t_min": 0.9})
    assert (fake.calls[0]["t_min"], fake.calls[0]["t_max"]) == (0.9, 1.0)


# ---- responses -----------------------------------------------------------------------------------------
def test_chat_response_has_the_text_finish_reason_and_usage():
    c, _ = client()
    out = c.post("/v1/chat/completions", json=CHAT).json()
    assert (
        out["object"] == "chat.completion" and out["model"] == "dgpipe" and out["id"].startswith("chatcmpl-")
    )
    assert out["choices"] == [
        {
            "index": 0,
            "finish_reason": "stop",
            "logprobs": None,
            "message": {"role": "assistant", "content": "1234"},
        }
    ]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_prompt_tokens_the_prefix_cache_held_are_usages_cached_tokens():
    """Triton's num_cached_tokens becomes OpenAI's usage.prompt_tokens_details.cached_tokens (what AIPerf
    and guidellm read for cache hits), whole and on the streamed usage chunk."""
    final = {**FINAL, "num_cached_tokens": [3]}
    c, _ = client(FakeTriton([{"text_output": ["12"]}, final]))
    usage = c.post("/v1/chat/completions", json=CHAT).json()["usage"]
    assert usage == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                     "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
    body = {**TEXT, "stream": True, "stream_options": {"include_usage": True}}
    assert sse(c.post("/v1/completions", json=body))[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 3
    }


def test_chat_stream_is_sse_one_chunk_per_canvas_then_usage_and_done():
    c, fake = client()
    r = c.post(
        "/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert fake.calls[0]["stream"] is True
    events = sse(r)
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and len({e["id"] for e in events}) == 1
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["12", "34"]
    assert events[3]["choices"][0]["finish_reason"] == "stop" and events[3]["usage"] is None
    assert events[4]["choices"] == [] and events[4]["usage"]["total_tokens"] == 9


def test_text_stream_without_include_usage_has_no_usage():
    c, _ = client()
    events = sse(c.post("/v1/completions", json={**TEXT, "stream": True}))
    assert [e["choices"][0]["text"] for e in events] == ["12", "34", ""]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in e for e in events)


DRAFTS = [
    {"text_output": ["1?"], "denoise_steps": [1]},
    {"text_output": ["12"], "denoise_steps": [2]},
    {"text_output": ["12"]},  # canvas 0 committed
    {"text_output": ["3?"], "denoise_steps": [1]},
    {"text_output": ["34"]},
    FINAL,
]


def test_drafts_only_when_asked_as_named_dgpipe_events_beside_unchanged_chunks():
    c, fake = client(FakeTriton(DRAFTS))
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r = c.post("/v1/chat/completions", json={**body, "stream_drafts": True})
    assert fake.calls[0]["stream_drafts"] is True
    blocks = [b for b in r.text.split("\n\n") if b]
    drafts = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in blocks if b.startswith("event: ")]
    assert all(b.startswith("event: dgpipe.draft\ndata: ") for b in blocks if b.startswith("event: "))
    assert [d["dgpipe"] for d in drafts] == [
        {"canvas": 0, "step": 1, "text": "1?", "index": 0},
        {"canvas": 0, "step": 2, "text": "12", "index": 0},
        {"canvas": 1, "step": 1, "text": "3?", "index": 0},
    ]
    assert all(d["object"] == "dgpipe.draft" and d["choices"] == [] for d in drafts)
    # the standard chunks are those of the same request without drafts, and the text has no draft in it
    plain = sse(client(FakeTriton(DRAFTS[2:3] + DRAFTS[4:]))[0].post("/v1/chat/completions", json=body))
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-1] if b.startswith("data: ")]
    strip = lambda es: [{k: v for k, v in e.items() if k not in ("id", "created")} for e in es]
    assert strip(chunks) == strip(plain) and chunks[-1]["usage"]["completion_tokens"] == 4
    # not asked: not sent to Triton; asked without streaming: refused
    c.post("/v1/chat/completions", json=body)
    assert "stream_drafts" not in fake.calls[1]
    assert_error(c.post("/v1/completions", json={**TEXT, "stream_drafts": True}), 400, "stream_drafts")


def test_the_cli_client_reads_drafts_back_and_keeps_them_out_of_the_text():
    from pipeline.serving.client import Reply, draft_of

    reply = Reply()
    for chunk in DRAFTS:
        reply.add(chunk)
    assert reply.text == "1234" and reply.drafts == 3
    assert draft_of(DRAFTS[0]) == (1, "1?") and draft_of(FINAL) is None


def test_models_and_health():
    c, _ = client()
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["dgpipe"]
    assert c.get("/v1/models/dgpipe").json()["object"] == "model"
    assert_error(c.get("/v1/models/other"), 404, "model", "model_not_found")
    assert c.get("/health").status_code == 200
    down, _ = client(ready=lambda: False)
    assert down.get("/health").status_code == 503


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"n": 9}, "n"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),  # chat's is a boolean
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"tools": []}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),  # needs tools
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"top_p": 0.5}, "top_p"),
        ("/v1/chat/completions", {"frequency_penalty": 1.0}, "frequency_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"1": 2}}, "logit_bias"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"seed": 2**64}, "seed"),
        ("/v1/chat/completions", {"seed": -(2**63) - 1}, "seed"),
        ("/v1/chat/completions", {"stop": ""}, "stop"),
        ("/v1/chat/completions", {"stop": ["x", ""]}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"frobnicate": True}}, "stream_options"),
        ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/chat/completions", {"temperature": 3}, "temperature"),
        ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"stop": ["a", "\u00e9" * 513]}, "stop"),  # 1,026 bytes of UTF-8, over the 1,024
        ("/v1/chat/completions", {"max_tokens": "10"}, "max_tokens"),  # JSON types as sent
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"stream_drafts": True}, "stream_drafts"),  # needs stream
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"metadata": {"k": 1}}, "metadata"),
    ],
)
def test_unsupported_or_bad_fields_are_a_400_naming_the_field(path, extra, param):
    c, fake = client()
    base = CHAT if "chat" in path else TEXT
    assert_error(c.post(path, json={**base, **extra}), 400, param)
    assert fake.calls == []  # refused before Triton is asked


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_a_400_not_a_422(raw):
    c, fake = client()
    assert_error(c.post("/v1/chat/completions", content=raw), 400, contains="JSON")
    assert fake.calls == []


@pytest.mark.parametrize(
    ("raw", "contains", "param"),
    [
        ('{"model": "dgpipe", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests", None),
        ('{"model": "dgpipe", "max_tokens": ' + "9" * 5000 + "}", "not valid JSON", None),
        (json.dumps({**CHAT, "guided_json": {}})[:-3] + '{"a": ' * 400 + "1" + "}" * 401, "cannot be read", "guided_json"),
    ],
)  # fmt: skip
def test_bodies_past_the_parsers_limits_are_a_400(raw, contains, param):
    """Nesting past JSON parsing's recursion limit, a number past Python's 4300-digit conversion limit, and a
    schema nested past llguidance's reader were 500s with a traceback: they are the request's problem."""
    c, fake = client()
    assert_error(c.post("/v1/chat/completions", content=raw.encode()), 400, param, contains=contains)
    assert fake.calls == []


def test_nan_and_infinity_are_refused_naming_the_field_and_other_content_types_are_a_415():
    c, fake = client()
    for field, literal in (("temperature", "NaN"), ("t_min", "Infinity"), ("entropy_bound", "-Infinity")):
        raw = f'{{"model": "dgpipe", "prompt": "x", "{field}": {literal}}}'.encode()
        assert_error(c.post("/v1/completions", content=raw), 400, field, contains="finite")
    json_body = json.dumps(TEXT).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        r = c.post("/v1/completions", content=json_body, headers={"content-type": ctype})
        assert_error(r, 415, code="unsupported_media_type", contains="application/json")
    assert fake.calls == []
    ok = {"content-type": "application/json; charset=utf-8"}
    assert c.post("/v1/completions", content=json_body, headers=ok).status_code == 200


def test_a_sidecar_answers_503_until_it_knows_its_model_then_serves_it_with_its_limits():
    """`dgpipe serve --triton-url` starts before Triton has the model: 503 (OpenAI's schema) until the
    supervisor hands it the model's name and the limits Triton reports, then those apply."""
    c, fake = client(model=None)
    assert_error(c.post("/v1/completions", json=TEXT), 503, None, "service_unavailable", "no model is ready")
    assert_error(c.get("/v1/models"), 503, None, "service_unavailable")
    c.app.state.openai.serve("tiny-chat", 100, 1000, 100)
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-chat"]
    assert c.post("/v1/completions", json={**TEXT, "model": "tiny-chat"}).status_code == 200 and fake.calls
    too_big = {"model": "tiny-chat", "prompt": "x" * 101}
    assert_error(c.post("/v1/completions", json=too_big), 400, "prompt", contains="limit of 100 bytes")


def test_missing_model_and_unknown_model():
    c, _ = client()
    assert_error(c.post("/v1/completions", json={"prompt": "x"}), 400, "model", contains="required")
    assert_error(c.post("/v1/completions", json={**TEXT, "model": "gpt-4"}), 404, "model", "model_not_found")


def test_triton_refusal_is_a_400_with_its_message_unreachable_a_503_internal_a_500():
    bad = FakeTriton(error=TritonError("input 'max_tokens' is 9999, over this server's limit of 512"))
    c, _ = client(bad)
    assert_error(c.post("/v1/completions", json=TEXT), 400, contains="over this server's limit")
    assert_error(c.post("/v1/completions", json={**TEXT, "stream": True}), 400, contains="limit")
    c, _ = client(FakeTriton(error=DgpipeError("cannot reach grpc://127.0.0.1:1")))
    assert_error(c.post("/v1/chat/completions", json=CHAT), 503, code="service_unavailable")
    c, _ = client(FakeTriton(error=TritonError("internal error during generation: boom", ErrorKind.INTERNAL)))
    assert_error(c.post("/v1/chat/completions", json=CHAT), 500, code="triton_error")


def test_an_error_after_the_stream_started_is_an_error_event_then_done():
    c, _ = client(
        FakeTriton(error=TritonError("internal error in this request: x", ErrorKind.INTERNAL), error_after=1)
    )
    events = sse(c.post("/v1/completions", json={**TEXT, "stream": True}))
    assert events[0]["choices"][0]["text"] == "12"
    assert (
        events[-1]["error"]["type"] == "server_error" and "internal error" in events[-1]["error"]["message"]
    )


def test_an_unset_seed_is_drawn_per_request_and_reported_any_64_bit_seed_is_mapped():
    c, fake = client()
    r1 = c.post("/v1/chat/completions", json=CHAT)
    r2 = c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    drawn = [call["seed"] for call in fake.calls]
    assert drawn[0] != drawn[1]  # two unseeded requests sample differently (2**-63 to collide)
    assert [r1.headers["x-dgpipe-seed"], r2.headers["x-dgpipe-seed"]] == [str(s) for s in drawn]
    for sent, used in ((7, 7), (-1, 2**63 - 1), (-(2**63), 0), (2**64 - 1, 2**63 - 1), (2**63, 0)):
        r = c.post("/v1/chat/completions", json={**CHAT, "seed": sent})
        assert r.status_code == 200 and fake.calls[-1]["seed"] == used == int(r.headers["x-dgpipe-seed"])


def test_text_content_parts_reach_triton_as_parts_and_other_parts_are_refused_by_type():
    c, fake = client()
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    body = {**CHAT, "messages": [{"role": "user", "content": parts}]}
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert json.loads(fake.calls[0]["messages"]) == [
        {"role": "user", "content": parts}
    ]  # the template's to read
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    body = {**CHAT, "messages": [{"role": "user", "content": [*parts, audio]}]}
    assert_error(c.post("/v1/chat/completions", json=body), 400, "messages", contains="'input_audio'")
    assert len(fake.calls) == 1


def test_nulls_are_defaults_and_bookkeeping_fields_are_accepted_unused():
    """OpenAI's spec lets any optional field be null (its default): `"n": null` and `"stream": null` were a
    400 where OpenAI and vLLM answer. The caller's bookkeeping fields, `store: false`, one service tier and
    the stream's obfuscation option are accepted and change nothing the model is sent."""
    c, fake = client()
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    nulls = {"n": None, "stream": None, "max_tokens": None, "stop": None, "stream_options": None, "seed": 7}
    kept = {"metadata": {"team": "a"}, "prompt_cache_key": "k", "safety_identifier": "u1", "store": False,
            "service_tier": "auto", "user": "u"}  # fmt: skip
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        r = c.post(path, json={**base, **nulls, **kept})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    assert {k: v for k, v in fake.calls[1].items() if k != "messages"} == {
        k: v for k, v in fake.calls[2].items() if k != "text_input"
    }
    assert fake.calls[1]["seed"] == 7 and fake.calls[1]["stream"] is False
    body = {**TEXT, "stream": True, "stream_options": {"include_usage": None, "include_obfuscation": False}}
    assert not any("usage" in e for e in sse(c.post("/v1/completions", json=body)))  # include_usage: default


def test_load_tool_fields_are_accepted_and_sent_to_the_model():
    """What guidellm and AIPerf send: vLLM's ignore_eos and min_tokens, continuous_usage_stats."""
    c, fake = client()
    body = {**CHAT, "max_tokens": 64, "ignore_eos": True, "min_tokens": 8}
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert fake.calls[0]["ignore_eos"] is True and fake.calls[0]["min_tokens"] == 8
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert "ignore_eos" not in fake.calls[1] and "min_tokens" not in fake.calls[1]


# two pieces with the usage so far (5 prompt tokens; 2, then 4 completion tokens), then the final response
USAGE_CHUNKS = [
    {"text_output": ["12"], "num_input_tokens": [5], "num_output_tokens": [2]},
    {"text_output": ["34"], "num_input_tokens": [5], "num_output_tokens": [4]},
    FINAL,
]


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk():
    c, _ = client(FakeTriton(USAGE_CHUNKS))
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse(c.post("/v1/completions", json={**TEXT, "stream": True, "stream_options": options}))
    assert [e["usage"]["completion_tokens"] for e in events] == [2, 4, 4, 4]
    assert all(e["usage"]["prompt_tokens"] == 5 for e in events)
    assert events[-1]["choices"] == []  # the include_usage chunk still ends the stream


def test_continuous_usage_stats_in_a_chat_stream_starts_with_the_prompt_tokens_on_the_role_chunk():
    """As vLLM does: the role chunk already carries usage (prompt tokens, 0 completion tokens), so a load
    tool reading usage on every chunk (AIPerf --per-chunk-usage) finds it on every one."""
    c, _ = client(FakeTriton(USAGE_CHUNKS))
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse(c.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": options}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 2, 4, 4, 4]
    assert [e["usage"]["total_tokens"] for e in events] == [5, 7, 9, 9, 9]
    # without continuous usage the role chunk's usage stays null (OpenAI's shape with include_usage)
    events = sse(
        c.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": options | {"continuous_usage_stats": False}},
        )
    )
    assert events[0]["usage"] is None


def test_a_deadline_inside_a_stream_carries_the_same_code_as_without_a_stream():
    deadline = TritonError("request ran past its deadline of 2 s", ErrorKind.TIMEOUT)
    c, _ = client(FakeTriton(error=deadline, error_after=1))
    events = sse(c.post("/v1/completions", json={**TEXT, "stream": True}))
    assert events[-1]["error"]["code"] == "timeout"
    c, _ = client(FakeTriton(error=deadline))
    assert_error(c.post("/v1/completions", json=TEXT), 504, code="timeout")


# ---- API key -------------------------------------------------------------------------------------------
def test_api_key_guards_v1_but_not_health():
    c, fake = client(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        assert_error(c.post("/v1/chat/completions", json=CHAT, headers=headers), 401, code="invalid_api_key")
        assert_error(c.get("/v1/models", headers=headers), 401, code="invalid_api_key")
    assert fake.calls == []
    assert c.get("/health").status_code == 200
    ok = {"Authorization": "Bearer s3cret"}
    assert c.post("/v1/chat/completions", json=CHAT, headers=ok).status_code == 200
    assert c.get("/v1/models", headers=ok).status_code == 200
    # an unknown route answers in the same schema
    assert_error(c.get("/v2/nothing"), 404, code="not_found")


# ---- the client side (dgpipe generate --url http://HOST:9000/v1) ---------------------------------------
def test_openai_body_maps_triton_inputs_back_and_refuses_what_has_no_field():
    from pipeline.serving.client import openai_body
    from pipeline.serving.schema import request_body

    body = request_body(
        "1..2", 82, False, 7, {"stop_words": ["x"], "t_max": 0.5, "exclude_input_in_output": True}
    )
    path, req = openai_body(body)
    assert path == "/completions"
    assert req == {
        "model": "dgpipe",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 82,
        "seed": 7,
        "t_max": 0.5,
        "stop": ["x"],
        "prompt": "1..2",
    }
    path, req = openai_body(request_body(None, 8, True, 0, {"messages": json.dumps(CHAT["messages"])}))
    assert path == "/chat/completions" and req["messages"] == CHAT["messages"]
    with pytest.raises(DgpipeError, match="infill_template"):
        openai_body(request_body("x", 8, False, 0, {"infill_template": "__"}))


def test_a_client_that_goes_away_mid_stream_cancels_its_triton_request():
    """Driven at the ASGI level: the client disconnects after the first event; the Triton stream is closed
    (AsyncTriton then cancels the gRPC call, and Triton the request) instead of running to the end."""
    import anyio

    seen = threading.Event()

    async def slow(model, inputs):
        try:
            yield {"text_output": ["12"]}
            seen.set()
            await anyio.sleep(10)
            slow.ran_to_the_end = True
        finally:
            slow.cancelled = True

    slow.cancelled = slow.ran_to_the_end = False
    app = create_app(slow)
    body = json.dumps({**TEXT, "stream": True}).encode()
    sent: list[dict] = []

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            while not seen.is_set():  # disconnect once the first canvas went out
                await anyio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = completion_scope()
        with anyio.fail_after(20):
            await app(scope, receive, send)

    anyio.run(run)
    for _ in range(100):  # the worker thread notices the cancel within its poll
        if slow.cancelled:
            break
        time.sleep(0.05)
    assert slow.cancelled and not slow.ran_to_the_end
    assert sent[0]["status"] == 200 and b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)


def test_draining_refuses_new_requests_with_503_and_health_503_while_a_stream_in_flight_finishes():
    """SIGTERM in `dgpipe serve` drains through the Admission: a stream already open runs to its last
    event and counts as in flight until then; a request after drain() is a 503 in OpenAI's schema."""
    from pipeline.serving.openai_api import Admission

    release, started = threading.Event(), threading.Event()

    async def slow(model, inputs):
        yield {"text_output": ["12"]}
        started.set()
        assert await anyio.to_thread.run_sync(release.wait, 10)  # off the event loop: drain requests go on
        yield FINAL

    admission = Admission()
    http = TestClient(create_app(slow, admission=admission))
    events: list = []
    stream = threading.Thread(
        target=lambda: events.extend(sse(http.post("/v1/completions", json={**TEXT, "stream": True})))
    )
    stream.start()
    assert started.wait(10) and admission.inflight == 1
    admission.drain()
    assert_error(
        http.post("/v1/completions", json=TEXT), 503, code="service_unavailable", contains="draining"
    )
    assert http.get("/health").status_code == 503
    release.set()
    stream.join(10)
    assert admission.inflight == 0  # sse() checked the stream ended with [DONE]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"]


def test_a_draining_model_is_a_503_and_a_request_past_its_deadline_a_504():
    """The model's lifecycle refusals over gRPC (the client reads their kind from the tag on the wire, not
    from their wording) reach an OpenAI client as 503 / 504, not as a 400 for a bad request."""
    from pipeline.serving import schema
    from pipeline.serving.client import model_error

    deadline = f"{schema.PAST_DEADLINE} of 2 s and was stopped after 1 canvas(es)"
    wire = [
        ErrorKind.UNAVAILABLE.on_wire(schema.DRAINING),
        ErrorKind.TIMEOUT.on_wire(deadline),
        ErrorKind.INTERNAL.on_wire("during generation: x"),
        ErrorKind.INVALID_REQUEST.on_wire("input 'seed' ..."),
        "input 'seed' ... draining past its deadline",  # untagged (Triton's own): the text decides nothing
    ]
    assert [model_error(m).status for m in wire] == [503, 504, 500, 400, 400]
    assert str(model_error(wire[0])) == schema.DRAINING  # the tag is not part of the message
    http, _ = client(FakeTriton(error=TritonError(schema.DRAINING, ErrorKind.UNAVAILABLE)))
    assert_error(
        http.post("/v1/completions", json=TEXT), 503, code="service_unavailable", contains="draining"
    )
    http, _ = client(FakeTriton(error=TritonError(deadline, ErrorKind.TIMEOUT)))
    assert_error(http.post("/v1/completions", json=TEXT), 504, code="timeout", contains="deadline")


def test_a_prompt_over_the_byte_cap_is_a_400_and_a_body_over_its_bound_a_413_before_triton():
    """max_prompt_bytes bounds the prompt's text (`prompt`, or every string of `messages`) and, through
    request_bytes_limit, the body itself: nothing of either reaches Triton."""
    from pipeline.limits import request_bytes_limit

    http, fake = client(max_prompt_bytes=100)
    text = {**TEXT, "prompt": "é" * 51}  # 102 UTF-8 bytes in 51 characters
    assert_error(http.post("/v1/completions", json=text), 400, "prompt", contains="102 bytes of text prompt")
    chat = {**CHAT, "messages": [{"role": "user", "content": "x" * 90}, {"role": "user", "content": "y"}]}
    err = assert_error(http.post("/v1/chat/completions", json=chat), 400, "messages")
    assert "over this server's limit of 100 bytes (max_prompt_bytes)" in err["message"]
    limit = request_bytes_limit(100)
    body = json.dumps({**TEXT, "prompt": "z" * limit}).encode()
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large", contains=f"{len(body)} bytes, over this server's limit")

    def chunked():  # no Content-Length: the size is counted as the body streams in
        yield body[: len(body) // 2]
        yield body[len(body) // 2 :]

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large", contains=f"more than {limit} bytes")
    assert fake.calls == []
    assert http.post("/v1/completions", json={**TEXT, "prompt": "é" * 50}).status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {**TEXT, "prompt": "a\ud800"}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ("/v1/completions", {**TEXT, "stop": ["\udfff"]}, "stop"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(path, body, param):
    """JSON can escape a lone surrogate; UTF-8 (the Triton inputs) cannot carry it: refused up front."""
    http, fake = client()
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as its \\u escape
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, param, contains="a lone surrogate that is not valid Unicode")
    assert fake.calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_cancelled_in_triton_when_its_client_disconnects_before_any_output(stream):
    """The whole completion, or a stream's first chunk (a batch slot and a whole canvas away: the client
    may give up while queued), is awaited while the client's connection is watched: when it closes, the
    Triton stream is closed (AsyncTriton then cancels the gRPC call) instead of running to its end."""
    started = threading.Event()

    async def slow(model, inputs):
        try:
            started.set()
            await anyio.sleep(10)  # Triton computing the whole answer (one response when not streamed)
            slow.ran_to_the_end = True
            yield FINAL
        finally:
            slow.closed = time.monotonic()

    slow.closed, slow.ran_to_the_end = None, False
    app = create_app(slow)
    body = json.dumps({**TEXT, "stream": stream}).encode()
    sent: list[dict] = []
    left = 0.0

    async def run() -> None:
        nonlocal left
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            nonlocal left
            if messages:
                return messages.pop(0)
            while not started.is_set():
                await anyio.sleep(0.01)
            await anyio.sleep(0.2)
            left = time.monotonic()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = completion_scope()
        with anyio.fail_after(5):  # the stream's 10 s would fail this: the request must end with the client
            await app(scope, receive, send)

    anyio.run(run)
    assert slow.closed is not None and not slow.ran_to_the_end
    assert 0 <= slow.closed - left < 0.3


@pytest.mark.parametrize("stream", [False, True])
def test_every_503_carries_retry_after_as_the_frontends_own_drain_does(stream):
    """A model that drains, ran out of GPU memory or is shutting down answers UNAVAILABLE: the 503 says when
    to retry, as the frontend's own draining 503 does (load balancers and clients honour Retry-After)."""
    from pipeline.serving import schema

    for message in (schema.DRAINING, "the GPU ran out of memory at a batch of 2 requests: retry"):
        http, _ = client(FakeTriton(error=TritonError(message, ErrorKind.UNAVAILABLE)))
        r = http.post("/v1/completions", json={**TEXT, "stream": stream})
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", (message, r.headers)
