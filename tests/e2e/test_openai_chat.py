"""`dgpipe serve` on a transformers-written tiny chat checkpoint (chat template, character tokenizer), packaged
by `dgpipe package` and asked with the official `openai` client: chat and text completions (sync and async),
the same tokens as `dgpipe generate --chat`, 16 concurrent streams equal to the same requests sent alone,
a client that goes away mid-stream, drafts only when asked, and bad inputs of every kind answered with a
4xx in OpenAI's error schema while the server keeps serving. One server for the module."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import pydantic
import pytest

from tests._utils.availability import needs_tritonserver
from tests._utils.chat import write_chat_checkpoint
from tests._utils.cli import ROOT, dgpipe
from tests._utils.serve import Serve, metric, start_serve

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = [
    needs_tritonserver,
    pytest.mark.slow,  # ~40 s to package and start the server
]

KEY = "test-key-0123"
MAX_TOKENS_LIMIT, MAX_PROMPT = 64, 200
QUESTION = "What is 2+2?"


class Chat:
    """The module's server and the checkpoint it serves."""

    def __init__(self, ckpt: Path, srv: Serve) -> None:
        self.ckpt, self.srv, self.url, self.proc = ckpt, srv, srv.openai, srv.proc

    def metric(self, name: str) -> float:
        return metric(self.srv.metrics, name)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    work = tmp_path_factory.mktemp("openai_chat")
    ckpt = write_chat_checkpoint(work / "ckpt")
    repo = work / "repo"
    dgpipe(
        "package", "--model", str(ckpt), "--output", str(repo), "--max-batch", "16", "--device", "cpu",
        "--max-tokens", str(MAX_TOKENS_LIMIT), "--max-prompt", str(MAX_PROMPT), ok=True, cwd=ROOT,
    )  # fmt: skip
    srv = start_serve(repo, work, {"DGPIPE_API_KEY": KEY})
    try:
        yield Chat(ckpt, srv)
    finally:
        srv.stop()


@pytest.fixture
def client(chat):
    return openai.OpenAI(base_url=chat.url, api_key=KEY, max_retries=0, timeout=120)


def template_len(ckpt: Path, messages: list[dict]) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def test_chat_and_text_completions_read_the_checkpoints_template(chat, client):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    resp = client.chat.completions.create(model="dgpipe", messages=messages, max_tokens=24, seed=1)
    assert resp.usage.prompt_tokens == template_len(chat.ckpt, messages)  # transformers is the oracle
    assert 0 < resp.usage.completion_tokens <= 24 and resp.choices[0].finish_reason in ("stop", "length")
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    text = client.completions.create(model="dgpipe", prompt=QUESTION, max_tokens=16, seed=1)
    assert text.usage.prompt_tokens == 1 + len(QUESTION)  # "<bos>" + one token per character, no template
    assert text.choices[0].text and text.choices[0].text != resp.choices[0].message.content

    async def streamed() -> tuple[str, int]:
        async with openai.AsyncOpenAI(base_url=chat.url, api_key=KEY, max_retries=0, timeout=120) as aclient:
            stream = await aclient.chat.completions.create(
                model="dgpipe", messages=messages, max_tokens=24, seed=1, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [c async for c in stream]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    text_streamed, usage = asyncio.run(streamed())
    assert text_streamed == resp.choices[0].message.content and usage == resp.usage  # same seed, same answer


def test_chat_completions_give_the_tokens_of_dgpipe_generate_chat_with_the_same_seed(chat, client):
    """The issue's done-when: the endpoint and the in-process CLI agree token for token; `dgpipe generate
    --url .../v1 --drafts` gets the same answer too, with the drafts on stderr and never in the text."""
    system, seed = "Answer briefly.", "7"
    common = ["--chat", QUESTION, "--system", system, "--seed", seed, "--max-tokens", "32"]
    local = json.loads(
        dgpipe("generate", "--model", str(chat.ckpt), "--device", "cpu", *common, "--json", ok=True).stdout
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    resp = client.chat.completions.create(model="dgpipe", messages=messages, max_tokens=32, seed=int(seed))
    assert resp.choices[0].message.content == local["text"]
    assert resp.usage.completion_tokens == len(local["tokens"])
    assert resp.usage.prompt_tokens == local["prompt_tokens"]
    assert resp.choices[0].finish_reason == local["finish_reason"]
    remote = dgpipe("generate", "--url", chat.url, "--api-key", KEY, *common, "--drafts", ok=True)
    assert remote.stdout == local["text"] + "\n"
    assert "[step  1] " in remote.stderr and "[step  4] " in remote.stderr  # 4 steps: generation_config


def test_16_concurrent_streams_all_complete_equal_to_the_same_requests_alone(chat):
    questions = [f"Question {i}: what is {i}+{i}?" for i in range(16)]

    async def ask(aclient, i: int) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model="dgpipe", messages=[{"role": "user", "content": questions[i]}], max_tokens=48, seed=100 + i,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[
            -1
        ].usage.completion_tokens

    async def run(together: bool) -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=chat.url, api_key=KEY, max_retries=0, timeout=300) as aclient:
            if together:
                return list(await asyncio.gather(*(ask(aclient, i) for i in range(16))))
            return [await ask(aclient, i) for i in range(16)]

    together = asyncio.run(run(True))
    alone = asyncio.run(run(False))
    assert together == alone
    assert all(n > 0 for _, n in together) and len({t for t, _ in together}) > 8  # real, distinct answers


def test_a_client_that_goes_away_mid_stream_leaves_nothing_running(chat, client):
    cancelled = chat.metric("dgpipe_requests_cancelled_total")
    stream = client.chat.completions.create(
        model="dgpipe", messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS_LIMIT,
        stream=True, extra_body={"stream_drafts": True, "max_denoising_steps": 256, "confidence_threshold": 0.0},
    )  # fmt: skip
    first = [next(stream) for _ in range(2)]  # the role chunk, then the first draft of a ~1000-step request
    assert first[1].object == "dgpipe.draft" and first[1].dgpipe["step"] == 1
    assert chat.metric("dgpipe_active_requests") == 1
    stream.close()  # the client goes away
    deadline = time.monotonic() + 30
    while chat.metric("dgpipe_active_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert chat.metric("dgpipe_active_requests") == 0 and chat.metric("dgpipe_queued_requests") == 0
    assert chat.metric("dgpipe_requests_cancelled_total") == cancelled + 1  # dropped, not finished
    start = time.monotonic()
    resp = client.chat.completions.create(
        model="dgpipe", messages=[{"role": "user", "content": QUESTION}], max_tokens=8
    )
    assert resp.usage.completion_tokens > 0 and time.monotonic() - start < 20


def test_drafts_only_when_asked(client):
    def events(**extra) -> list:
        return list(
            client.chat.completions.create(
                model="dgpipe", messages=[{"role": "user", "content": QUESTION}], max_tokens=32, seed=3,
                stream=True, extra_body={"max_denoising_steps": 4, "confidence_threshold": 0.0, **extra},
            )
        )  # fmt: skip

    plain, with_drafts = events(), events(stream_drafts=True)
    assert all(c.object == "chat.completion.chunk" for c in plain)
    drafts = [c.dgpipe for c in with_drafts if c.object == "dgpipe.draft"]
    assert [(d["canvas"], d["step"]) for d in drafts] == [(k, s) for k in range(2) for s in range(1, 5)]
    chunks = [c for c in with_drafts if c.object != "dgpipe.draft"]
    assert [c.choices for c in chunks] == [c.choices for c in plain]  # the same answer, drafts aside
    assert drafts[3]["text"] == plain[1].choices[0].delta.content  # canvas 0's last draft is what it commits


def post(chat, path: str, body: bytes | dict, content_type: str = "application/json") -> tuple[int, dict]:
    """(status, JSON body) of a raw POST: what no client library would send."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    req = urllib.request.Request(chat.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


USER = [{"role": "user", "content": QUESTION}]
BAD = [  # (name, path, body, content type, the param named)
    ("missing messages", "/chat/completions", {"model": "dgpipe"}, None, "messages"),
    ("messages not a list", "/chat/completions", {"model": "dgpipe", "messages": "hi"}, None, "messages"),
    ("max_tokens a string", "/chat/completions", {"messages": USER, "max_tokens": "10"}, None, "max_tokens"),
    ("empty messages", "/chat/completions", {"messages": []}, None, "messages"),
    (
        "unknown role",
        "/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        None,
        "messages",
    ),
    ("max_tokens 0", "/chat/completions", {"messages": USER, "max_tokens": 0}, None, "max_tokens"),
    ("max_tokens negative", "/completions", {"prompt": QUESTION, "max_tokens": -5}, None, "max_tokens"),
    ("max_tokens over the server's cap", "/completions", {"prompt": "x", "max_tokens": 10**6}, None, None),
    ("max_tokens over INT32", "/completions", {"prompt": "x", "max_tokens": 2**40}, None, "max_tokens"),
    (
        "temperature NaN",
        "/completions",
        b'{"model": "dgpipe", "prompt": "x", "temperature": NaN}',
        None,
        "temperature",
    ),
    ("temperature negative", "/completions", {"prompt": "x", "temperature": -0.5}, None, "temperature"),
    ("temperature huge", "/completions", {"prompt": "x", "temperature": 1e9}, None, "temperature"),
    ("seed below -2**63", "/completions", {"prompt": "x", "seed": -(2**63) - 1}, None, "seed"),
    ("seed over 64 bits", "/completions", {"prompt": "x", "seed": 2**64}, None, "seed"),
    ("logprobs as a count in chat", "/chat/completions", {"messages": USER, "logprobs": 3}, None, "logprobs"),
    ("top_logprobs over 20", "/completions", {"prompt": "x", "logprobs": 21}, None, "logprobs"),
    (
        "tools without a function",
        "/chat/completions",
        {"messages": USER, "tools": [{"type": "function"}]},
        None,
        "tools",
    ),
    ("n over 8", "/chat/completions", {"messages": USER, "n": 9}, None, "n"),
    # a response_format no server supports (json_schema may be supported by the time this runs)
    (
        "response_format",
        "/chat/completions",
        {"messages": USER, "response_format": {"type": "x-yaml"}},
        None,
        None,
    ),
    ("five stop sequences", "/completions", {"prompt": "x", "stop": list("abcde")}, None, "stop"),
    ("prompt too long", "/completions", {"prompt": "x" * (MAX_PROMPT + 50)}, None, None),
    ("entropy_bound out of range", "/completions", {"prompt": "x", "entropy_bound": -1.0}, None, None),
    ("unknown field", "/completions", {"prompt": "x", "frobnicate": 1}, None, "frobnicate"),
    ("malformed JSON", "/chat/completions", b'{"model": "dgpipe", "messages": [', None, None),
    ("a JSON array", "/chat/completions", b"[1, 2]", None, None),
    ("wrong content type", "/completions", {"prompt": "x"}, "text/plain", None),
]


def test_bad_inputs_are_4xx_in_openais_schema_and_the_server_keeps_serving(chat, client):
    assert len(BAD) >= 12
    for name, path, body, ctype, param in BAD:
        if isinstance(body, dict):
            body = {"model": "dgpipe", **body}
        status, out = post(chat, path, body, ctype or "application/json")
        assert 400 <= status < 500, (name, status, out)
        err = out["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", (
            name
        )
        assert err["message"] and "Traceback" not in err["message"], name
        if param is not None:
            assert err["param"] == param, (name, err)
        # and the next valid request is answered
        ok = client.completions.create(model="dgpipe", prompt="ok?", max_tokens=4, seed=0)
        assert ok.usage.completion_tokens > 0, name
    # the model's own refusals keep its message
    status, out = post(chat, "/completions", {"model": "dgpipe", "prompt": "x" * (MAX_PROMPT + 50)})
    assert status == 400 and f"over this server's limit of {MAX_PROMPT}" in out["error"]["message"]
    assert chat.proc.poll() is None


class Weather(pydantic.BaseModel):
    """A tool's arguments as the client declares them (openai.pydantic_function_tool: a strict schema)."""

    city: str = pydantic.Field(max_length=6)
    unit: Literal["c", "f"]


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": Weather.model_json_schema()},
}


def test_n_choices_equal_single_requests_with_the_derived_seeds(client):
    """n=4 with seed S: choice i is the answer of one request with its seed, listed in the response's
    x-dgpipe-choice-seeds header (choice 0's is S; README, "n")."""
    from pipeline.serving.openai_schema import choice_seed

    messages = [{"role": "user", "content": QUESTION}]
    common = {"model": "dgpipe", "messages": messages, "max_tokens": 24, "temperature": 1.0}
    raw = client.chat.completions.with_raw_response.create(n=4, seed=41, **common)
    seeds = [choice_seed(41, i) for i in range(4)]
    assert raw.headers["x-dgpipe-choice-seeds"] == ",".join(map(str, seeds)) and seeds[0] == 41
    many = raw.parse()
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    singles = [client.chat.completions.create(seed=s, **common) for s in seeds]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert [c.finish_reason for c in many.choices] == [s.choices[0].finish_reason for s in singles]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert len({c.message.content for c in many.choices}) > 1  # different seeds, different samples
    text = client.completions.create(model="dgpipe", prompt=QUESTION, max_tokens=16, n=2, seed=5)
    alone = client.completions.create(model="dgpipe", prompt=QUESTION, max_tokens=16, seed=choice_seed(5, 1))
    assert text.choices[1].text == alone.choices[0].text


def test_logprobs_cover_the_returned_tokens_whole_and_streamed(chat, client):
    messages = [{"role": "user", "content": QUESTION}]
    common = {"model": "dgpipe", "messages": messages, "max_tokens": 32, "seed": 3}
    resp = client.chat.completions.create(logprobs=True, top_logprobs=3, **common)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens  # one entry per counted token
    assert "".join(e.token for e in content) == choice.message.content  # the tokens spell the text
    for e in content:
        assert bytes(e.bytes).decode() == e.token
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        alts = [a.logprob for a in e.top_logprobs]
        assert alts == sorted(alts, reverse=True)
        # the committed token is the argmax of the pass that committed it: the first alternative
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    total = sum(e.logprob for e in content)  # the answer's log-probability under its committing passes
    assert -1e4 < total < 0
    assert client.chat.completions.create(**common).choices[0].message.content == choice.message.content

    async def streamed() -> list:
        async with openai.AsyncOpenAI(base_url=chat.url, api_key=KEY, max_retries=0, timeout=120) as aclient:
            stream = await aclient.chat.completions.create(
                stream=True, logprobs=True, top_logprobs=3, **common
            )
            return [c async for c in stream]

    chunks = asyncio.run(streamed())
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]
    text = client.completions.create(model="dgpipe", prompt=QUESTION, max_tokens=16, seed=3, logprobs=2)
    lp = text.choices[0].logprobs
    assert (
        "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == text.usage.completion_tokens
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2, top  # keyed by text: special tokens that all read "" share one key
        assert not token or top[token] == v, (token, v, top)


def test_forced_tool_calls_parse_and_validate_sync_async_and_with_pydantic(chat, client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for seed in range(4):
        resp = client.chat.completions.create(
            model="dgpipe", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", seed=seed,
        )  # fmt: skip
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        Weather.model_validate_json(call.function.arguments)
    parsed = client.chat.completions.parse(
        model="dgpipe", messages=messages, tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={"type": "function", "function": {"name": "Weather"}}, seed=9,
    )  # fmt: skip
    (call,) = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)

    async def streamed():
        async with openai.AsyncOpenAI(base_url=chat.url, api_key=KEY, max_retries=0, timeout=120) as aclient:
            stream = await aclient.chat.completions.create(
                model="dgpipe", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", seed=0,
                stream=True,
            )  # fmt: skip
            return [c async for c in stream]

    chunks = asyncio.run(streamed())
    calls = [
        t
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for t in c.choices[0].delta.tool_calls
    ]
    whole = client.chat.completions.create(
        model="dgpipe", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", seed=0
    )  # fmt: skip
    assert [c.function.arguments for c in calls] == [
        whole.choices[0].message.tool_calls[0].function.arguments
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_is_refused_where_the_template_declares_no_tool_call_format(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="dgpipe", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL]
        )
    assert "tool_choice 'auto' needs a chat template that declares a tool-call format" in str(e.value)
    none = client.chat.completions.create(
        model="dgpipe", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], tool_choice="none",
        max_tokens=8, seed=1,
    )  # fmt: skip
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_the_server_stops_cleanly_after_everything_above(chat):
    """Last in the file. Triton unloads the model only when every request was released, the one whose
    client went away included; a request left holding it would make Ctrl-C wait and end in a kill."""
    chat.proc.send_signal(signal.SIGINT)
    assert chat.proc.wait(60) == 0, chat.srv.stderr.read_text(errors="replace")[-3000:]
