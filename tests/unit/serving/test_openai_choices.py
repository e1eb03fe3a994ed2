"""The OpenAI frontend's n, logprobs and tools against a fake Triton stream: n choices as n requests with
the derived seeds, each choice's log-probabilities in the chat and the legacy completions shapes (streamed
too), and tool calls from a forced call's JSON or a Hermes-format reply."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from pipeline.serving.openai_schema import SEED_SPACE, choice_seed
from pipeline.serving.openai_tools import parse_hermes, tool_plan
from tests.unit.serving.test_openai_api import CHAT, TEXT, FakeTriton, assert_error, client, sse

A = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -1.5, "bytes": [98]}]}  # fmt: skip
B = {"token": "b", "logprob": -0.25, "bytes": [98], "top_logprobs": [{"token": "b", "logprob": -0.25, "bytes": [98]}, {"token": "a", "logprob": -2.0, "bytes": [97]}]}  # fmt: skip
LP_CHUNKS = [
    {"text_output": ["a"], "logprobs": [json.dumps([A])]},
    {"text_output": ["b"], "logprobs": [json.dumps([B])]},
    {"text_output": [""], "finish_reason": ["stop"], "num_input_tokens": [3], "num_output_tokens": [2], "logprobs": ["[]"]},
]  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
OTHER = {"type": "function", "function": {"name": "get_time"}}


def test_n_choices_are_n_requests_with_derived_seeds_and_usage_counts_every_choice():
    c, fake = client()
    r = c.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 2**63 - 2})
    assert r.status_code == 200, r.text
    seeds = [call["seed"] for call in fake.calls]
    assert seeds == [choice_seed(2**63 - 2, i) for i in range(3)] and seeds[0] == 2**63 - 2
    assert r.headers["x-dgpipe-choice-seeds"] == ",".join(map(str, seeds))
    assert all({k: v for k, v in call.items() if k != "seed"} == {k: v for k, v in fake.calls[0].items() if k != "seed"} for call in fake.calls)  # fmt: skip
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert all(ch["message"]["content"] == "1234" for ch in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    r = c.post(
        "/v1/completions", json={**TEXT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = sse(r)
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        for ch in e["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts == {0: "1234", 1: "1234"} and events[-1]["usage"]["completion_tokens"] == 8


def test_choice_seeds_are_splitmix64s_stream_so_neighbouring_seeds_share_no_choice():
    """Choice 0 samples with the request's seed; choice i with the i-th SplitMix64 output seeded with it
    (Steele, Lea and Flood's generator; its first outputs from state 0 are the published test vector), in
    the 63-bit seed space. With seed + i, requests seeded s and s + 1 shared all but one of their choices."""
    splitmix_from_zero = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [choice_seed(0, i) for i in (1, 2, 3)] == [v % SEED_SPACE for v in splitmix_from_zero]
    assert SEED_SPACE == 2**63 and choice_seed(12345, 0) == 12345
    draws = {choice_seed(s, i) for s in range(100) for i in range(8)}
    assert len(draws) == 800 and all(0 <= d < SEED_SPACE for d in draws)


def test_chat_logprobs_in_openais_shape_whole_and_streamed():
    c, fake = client(FakeTriton(LP_CHUNKS))
    r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
    assert fake.calls[0]["return_log_probs"] is True and fake.calls[0]["top_logprobs"] == 2
    choice = r.json()["choices"][0]
    assert choice["logprobs"] == {"content": [A, B], "refusal": None}
    assert "".join(e["token"] for e in choice["logprobs"]["content"]) == choice["message"]["content"]
    r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "stream": True})
    assert fake.calls[1]["return_log_probs"] is True and "top_logprobs" not in fake.calls[1]
    chunks = [e["choices"][0] for e in sse(r)[1:]]  # after the role chunk
    assert [ch["logprobs"] for ch in chunks] == [
        {"content": [A], "refusal": None},
        {"content": [B], "refusal": None},
        {"content": [], "refusal": None},  # the finish: its tokens went out with their text
    ]
    r = c.post("/v1/chat/completions", json=CHAT)
    assert "return_log_probs" not in fake.calls[2] and r.json()["choices"][0]["logprobs"] is None


def test_completions_logprobs_in_the_legacy_shape_with_text_offsets():
    c, fake = client(FakeTriton(LP_CHUNKS))
    r = c.post("/v1/completions", json={**TEXT, "logprobs": 2})
    assert fake.calls[0]["top_logprobs"] == 2
    assert r.json()["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"b": -0.25, "a": -2.0}],
        "text_offset": [0, 1],
    }
    r = c.post("/v1/completions", json={**TEXT, "logprobs": 0, "stream": True})
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in sse(r)] == [[0], [1], []]


def test_a_required_tool_call_is_generated_under_the_tools_schema_and_returned_as_tool_calls():
    answer = json.dumps({"name": "get_weather", "parameters": {"city": "Oslo"}})
    final = {
        "text_output": [""],
        "finish_reason": ["stop"],
        "num_input_tokens": [3],
        "num_output_tokens": [9],
    }
    c, fake = client(FakeTriton([{"text_output": [answer]}, final]))
    r = c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL, OTHER], "tool_choice": "required"})
    sent = fake.calls[0]
    assert json.loads(sent["tools"]) == [TOOL, OTHER] and "tool_choice" not in sent
    assert sent["guided_decoding_guide_type"] == "json_schema"
    schema = json.loads(sent["guided_decoding_guide"])
    names = [alt["properties"]["name"]["const"] for alt in schema["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["anyOf"][0]["properties"]["parameters"] == TOOL["function"]["parameters"]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}


def test_a_named_function_generates_its_arguments_streamed_as_one_tool_call_delta():
    final = {
        "text_output": [""],
        "finish_reason": ["stop"],
        "num_input_tokens": [3],
        "num_output_tokens": [9],
    }
    c, fake = client(FakeTriton([{"text_output": ['{"city": ']}, {"text_output": ['"Oslo"}']}, final]))
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "tool_choice": named, "stream": True})
    assert json.loads(fake.calls[0]["guided_decoding_guide"]) == TOOL["function"]["parameters"]
    events = sse(r)
    # the role, the whole call, then the finish on its own chunk (as OpenAI sends it: the `openai` client's
    # stream helper emits a call's arguments.done event only when a later chunk finishes the choice)
    assert len(events) == 3 and events[2]["choices"][0] == {"index": 0, "finish_reason": "tool_calls",
                                                            "logprobs": None, "delta": {}}  # fmt: skip
    choice = events[1]["choices"][0]
    assert choice["finish_reason"] is None
    (call,) = choice["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_auto_goes_to_the_model_and_none_sends_no_tools():
    """ "none" sends no tools (a model whose prompt format takes none would refuse them), no choice and no
    guide: the reply is text."""
    c, fake = client()
    c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL]})  # auto: OpenAI's default with tools
    assert fake.calls[0]["tool_choice"] == "auto" and "guided_decoding_guide" not in fake.calls[0]
    r = c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "tool_choice": "none"})
    assert "tools" not in fake.calls[1] and "tool_choice" not in fake.calls[1]
    assert (
        "guided_decoding_guide" not in fake.calls[1]
        and r.json()["choices"][0]["message"]["content"] == "1234"
    )
    assert_error(
        c.post("/v1/chat/completions", json={**CHAT, "tools": [], "tool_choice": "none"}), 400, "tools"
    )
    assert_error(
        c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL, TOOL], "tool_choice": "required"}),
        400,
        "tools",
    )


def test_an_auto_reply_streams_its_text_before_its_calls():
    """tool_choice "auto" (OpenAI's default with tools, what agents send): the text streams as it comes, up
    to the first <tool_call>, a tail that could begin one held until the next piece shows it does not; the
    calls, and the text left after them, come with the finish. It was one chunk at the end."""
    final = {
        "text_output": [""],
        "finish_reason": ["stop"],
        "num_input_tokens": [3],
        "num_output_tokens": [20],
    }
    pieces = ["Let me ", "check <", "b>Oslo</b>. <tool", '_call>{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}</tool_call> done']  # fmt: skip
    c, _ = client(FakeTriton([{"text_output": [p]} for p in pieces] + [final]))
    events = sse(c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    assert [d.get("content") for d in deltas[:-2]] == ["Let me ", "check ", "<b>Oslo</b>. "]
    assert deltas[-2]["content"] == " done" and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [t["function"]["name"] for t in deltas[-2]["tool_calls"]] == ["get_weather"]
    whole = c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL]}).json()["choices"][0]["message"]
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert whole["content"] == streamed == "Let me check <b>Oslo</b>.  done" and len(whole["tool_calls"]) == 1
    # no call at all: every piece streams, the held "<" with the finish
    c, _ = client(FakeTriton([{"text_output": ["a <"]}, {"text_output": ["tool"]}, final]))
    events = sse(c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:]) == "a <tool"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_hermes_calls_are_parsed_out_of_a_reply():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert parse_hermes("no call <tool_call>not json</tool_call>") == (
        "no call <tool_call>not json</tool_call>",
        [],
    )
    plan = tool_plan([TOOL], "auto")
    assert plan is not None and plan.guide() is None
    assert plan.calls("plain") == ("plain", [])


def test_parallel_tool_calls_false_keeps_an_auto_replys_first_call():
    """Agent SDKs send parallel_tool_calls: false (it was refused as unsupported): an "auto" reply keeps
    its first call, as vLLM reads it, and a forced call is one call either way."""
    two = "".join(
        f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in ("get_weather", "get_time")
    )
    final = {
        "text_output": [""],
        "finish_reason": ["stop"],
        "num_input_tokens": [3],
        "num_output_tokens": [9],
    }
    for parallel, names in ((False, ["get_weather"]), (True, ["get_weather", "get_time"])):
        c, _ = client(FakeTriton([{"text_output": [two]}, final]))
        body = {**CHAT, "tools": [TOOL, OTHER], "parallel_tool_calls": parallel}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [call["function"]["name"] for call in calls] == names
    named = {"type": "function", "function": {"name": "get_weather"}}
    c, _ = client(FakeTriton([{"text_output": ['{"city": "Oslo"}']}, final]))
    body = {**CHAT, "tools": [TOOL], "tool_choice": named, "parallel_tool_calls": False}
    assert len(c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]) == 1


def test_a_named_tool_choice_without_a_name_says_so():
    c, _ = client()
    r = c.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "tool_choice": {"type": "function"}})
    assert_error(r, 400, "tool_choice", contains="names no function")


def test_a_hermes_block_without_a_name_stays_in_the_content():
    """A `<tool_call>` block whose JSON names no function is text the model wrote, not a call: it stays in
    the reply's content instead of becoming a call the client cannot dispatch (or a KeyError, a 500)."""
    for block in ('{"arguments": {}}', '{"name": 7, "arguments": {}}', "[1, 2]"):
        text = f"<tool_call>{block}</tool_call>"
        assert parse_hermes(text) == (text, [])


def test_a_reply_of_only_tool_calls_has_no_content():
    """OpenAI's shape: a message that is only tool calls has content null (clients test `content is None`),
    not an empty string; text around a call is kept, stripped."""
    content, calls = parse_hermes(' \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n ')
    assert content is None
    assert [c["function"] for c in calls] == [{"name": "get_time", "arguments": "{}"}]
    content, _ = parse_hermes('Sure. <tool_call>{"name": "get_time"}</tool_call> Done.')
    assert content == "Sure.  Done."


def test_a_function_without_parameters_is_called_with_any_object():
    """OpenAI lets a function leave out `parameters`: a forced call to it is generated under {"type":
    "object"}, so the arguments are still a JSON object the client can parse."""
    plan = tool_plan([TOOL, OTHER], {"type": "function", "function": {"name": "get_time"}})
    assert plan is not None and plan.guide() == ("json_schema", '{"type": "object"}')
    assert plan.parameters("get_weather") == TOOL["function"]["parameters"]


def test_parameters_that_are_not_a_schema_object_are_refused_naming_tools():
    """`parameters` must be a JSON schema object: a list or a string is a 400 naming the tool and the field,
    not a guide compile error (or a crash) later."""
    from pipeline.serving.openai_schema import RequestError

    for bad in ([{"type": "string"}], "object", 7):
        tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
        with pytest.raises(RequestError) as e:
            tool_plan([OTHER, tool], "auto")
        assert (e.value.message, e.value.param) == (
            "'tools[1].function.parameters' must be a JSON schema object",
            "tools",
        )
    assert (
        tool_plan([{"type": "function", "function": {"name": "f", "parameters": None}}], "auto") is not None
    )


def test_a_required_call_is_generated_under_a_closed_schema_per_tool():
    """tool_choice "required" generates {"name", "parameters"} and nothing else: additionalProperties false,
    so the constraint cannot let the model add keys that the frontend then drops or chokes on."""
    plan = tool_plan([TOOL, OTHER], "required")
    assert plan is not None
    kind, guide = plan.guide()
    assert kind == "json_schema"
    assert json.loads(guide) == {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in (
                ("get_weather", TOOL["function"]["parameters"]),
                ("get_time", {"type": "object"}),
            )
        ]
    }


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_calls_unsupported_schema_keyword_is_a_400_naming_the_tool_and_its_pointer(choice):
    """Each schema a forced call may be generated under is checked before the request reaches Triton, as the
    user wrote it: the pointer is into that tool's `parameters`, not into the guide built around them."""
    ok = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}  # fmt: skip
    c, fake = client()
    r = c.post("/v1/chat/completions", json={**CHAT, "tools": [ok, bad], "tool_choice": choice})
    err = assert_error(r, 400, "tools", contains="'tools[1].function.parameters': ")
    assert "#/properties/a" in err["message"] and "anyOf" not in err["message"] and not fake.calls
    # a named call is generated under its own function's schema alone: another tool's is not its concern
    if isinstance(choice, dict):
        named_ok = {**choice, "function": {"name": "g"}}
        r = c.post("/v1/chat/completions", json={**CHAT, "tools": [ok, bad], "tool_choice": named_ok})
        assert r.status_code == 200, r.text
