"""Structured output through the OpenAI frontend: response_format and the guided_* extra fields become the
Triton guide inputs; what the compiler cannot honour is a 400 naming the field and the construct."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from pipeline.serving.client import openai_body
from pipeline.serving.openai_api import create_app

CHAT = {"model": "dgpipe", "messages": [{"role": "user", "content": "hi"}]}
FINAL = {"text_output": ['{"ok":true}'], "finish_reason": ["stop"], "num_input_tokens": [5], "num_output_tokens": [4]}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GRAMMAR = "start: /[a-c]{3,5}/"


def post(body: dict, path: str = "/v1/chat/completions"):
    calls: list[dict] = []

    async def triton(model, inputs):
        calls.append(inputs)
        yield FINAL

    return TestClient(create_app(triton)).post(path, json=body), calls


@pytest.mark.parametrize(
    ("extra", "guide"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}}, ("json_schema", json.dumps(SCHEMA))),
        ({"response_format": {"type": "json_object"}}, ("json", "")),
        ({"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]{3}"}, ("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
        ({"guided_grammar": GRAMMAR}, ("lark_grammar", GRAMMAR)),
        # vLLM's current field (its guided_* were removed in v0.12)
        ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA), "regex": None}}, ("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[0-9]{3}", "json_object": False}}, ("regex", "[0-9]{3}")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
        ({"structured_outputs": {"grammar": GRAMMAR}}, ("lark_grammar", GRAMMAR)),
        ({"structured_outputs": {"json_object": True}}, ("json", "")),
    ],
)  # fmt: skip
def test_structured_output_fields_become_the_triton_guide(extra, guide):
    r, calls = post({**CHAT, **extra})
    assert r.status_code == 200, r.text
    assert (calls[0]["guided_decoding_guide_type"], calls[0]["guided_decoding_guide"]) == guide
    r, calls = post({"model": "dgpipe", "prompt": "hi", **extra}, "/v1/completions")
    assert r.status_code == 200 and calls[0]["guided_decoding_guide_type"] == guide[0]


def test_text_response_format_sets_no_guide():
    r, calls = post({**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200 and "guided_decoding_guide_type" not in calls[0]


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format", "keyword 'uniqueItems' at #"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "o"}}}, "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "grammar"}}, "response_format", "'grammar' is not supported"),
        ({"guided_json": {"properties": {"a": {"not": {}}}}}, "guided_json", "'not' at #/properties/a"),
        ({"guided_regex": "(x"}, "guided_regex", "does not compile"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "x", "guided_choice": ["x"]}, "guided_choice", "exclude each other"),
        ({"structured_outputs": {"regex": "x", "choice": ["x"]}}, "structured_outputs.choice", "exclude each other"),
        ({"guided_regex": "x", "structured_outputs": {"grammar": GRAMMAR}}, "structured_outputs.grammar", "exclude each other"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "takes one of: json, regex"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "a list of strings"),
        ({"structured_outputs": {"regex": "(x"}}, "structured_outputs.regex", "does not compile"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", ""),
    ],
)  # fmt: skip
def test_guides_the_compiler_cannot_honour_are_400s_naming_the_construct(extra, param, needle):
    r, calls = post({**CHAT, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error"
    assert not calls  # refused before Triton


@pytest.mark.parametrize(
    ("kind", "guide", "field"),
    [
        ("json_schema", json.dumps(SCHEMA), {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}}),
        ("json", "", {"response_format": {"type": "json_object"}}),
        ("regex", "[0-9]+", {"structured_outputs": {"regex": "[0-9]+"}}),
        ("choice", '["a", "b"]', {"structured_outputs": {"choice": ["a", "b"]}}),
        ("lark_grammar", GRAMMAR, {"structured_outputs": {"grammar": GRAMMAR}}),
    ],
)  # fmt: skip
def test_cli_client_sends_the_guide_as_openai_fields_the_frontend_maps_back(kind, guide, field):
    body = {
        "text_input": "hi",
        "max_tokens": 8,
        "guided_decoding_guide_type": kind,
        "guided_decoding_guide": guide,
    }
    path, req = openai_body(body)
    assert path == "/completions" and {k: req[k] for k in field} == field
    r, calls = post(
        {k: v for k, v in req.items() if k not in ("stream", "stream_options")}, "/v1/completions"
    )
    assert r.status_code == 200 and (
        calls[0]["guided_decoding_guide_type"],
        calls[0]["guided_decoding_guide"],
    ) == (kind, guide)


def test_guides_over_the_served_size_limits_are_refused_before_they_are_parsed():
    """The repository's guide size limits hold in the frontend too (the model checks them again): a 400
    naming the field and the limit, and nothing sent to Triton."""
    calls: list[dict] = []

    async def triton(model, inputs):
        calls.append(inputs)
        yield FINAL

    http = TestClient(create_app(triton, guide_limits=(200, 50)))
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    for extra, field, limit in (
        ({"guided_regex": "[1-9]{51}"}, "guided_regex", "max_regex_positions"),
        ({"guided_json": big}, "guided_json", "max_guide_bytes"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": big}}}, "response_format", "max_guide_bytes"),
        # vLLM's fields too: a large grammar compiled in the request handler held every other request
        ({"structured_outputs": {"regex": "[1-9]{51}"}}, "structured_outputs.regex", "max_regex_positions"),
        ({"structured_outputs": {"json": big}}, "structured_outputs.json", "max_guide_bytes"),
        ({"structured_outputs": {"grammar": "start: " + "|".join(['"a"'] * 60)}}, "structured_outputs.grammar", "max_guide_bytes"),
        ({"guided_grammar": "start: " + "|".join(['"a"'] * 60)}, "guided_grammar", "max_guide_bytes"),
    ):  # fmt: skip
        r = http.post("/v1/chat/completions", json={**CHAT, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and f"({limit})" in err["message"], r.json()
    assert calls == []
    assert http.post("/v1/chat/completions", json={**CHAT, "guided_regex": "[1-9]{50}"}).status_code == 200
