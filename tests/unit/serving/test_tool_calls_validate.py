"""100 `tool_choice: "required"` calls on a random-weight model, in-process: the frontend's guide for the
tools, constrained denoising through the runtime, the frontend's parse of the reply. A random model can only
produce valid calls through the constraint, so every call must parse, name one of the tools and carry
arguments that validate against that tool's `parameters` (jsonschema is the oracle); a named function
likewise. The calls differ across seeds (the constraint leaves the model its choices). About 20 s on 2
cores (2 denoise steps per canvas, 25 rows a pass)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from pipeline.runtime.session import load_session
from pipeline.serving.openai_tools import tool_plan

OBJ = {"type": "object", "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {**OBJ, "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {**OBJ, "properties": {"on": {"type": "boolean"}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["on"]}}},
]  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = 100


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from tests._utils.chat import write_chat_checkpoint

    return load_session(write_chat_checkpoint(tmp_path_factory.mktemp("chat")), device="cpu")


def run(session, plan, seeds):
    automaton = session.compile_guide(*plan.guide())
    prompt = session.encode_messages([{"role": "user", "content": "What is the weather?"}], TOOLS)
    reqs = [
        Request(
            prompt,
            max_tokens=160,
            sampler=session.sampler(max_denoising_steps=2),
            seed=s,
            request_id=s,
            guide=automaton,
        )
        for s in seeds
    ]
    results = BlockDiffusionRuntime(session.model, max_batch=25, max_len=512).generate(reqs)
    return [session.decode(r.tokens) for r in results], results


def test_every_required_call_parses_names_a_tool_and_its_arguments_validate(session):
    plan = tool_plan(TOOLS, "required")
    texts, results = run(session, plan, range(CALLS))
    names = []
    for text, res in zip(texts, results, strict=True):
        assert res.finish_reason == "stop", text
        content, (call,) = plan.calls(text)
        assert content is None and call["type"] == "function"
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, PARAMS[name])
        names.append(name)
    assert len(set(texts)) > CALLS // 2 and len(set(names)) >= 2  # the model's own choices


def test_a_named_function_call_validates(session):
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}})
    texts, _ = run(session, plan, range(10))
    for text in texts:
        _, (call,) = plan.calls(text)
        assert call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS["add"])
