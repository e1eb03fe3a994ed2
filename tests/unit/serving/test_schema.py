"""pipeline/serving/schema.py is the one request/response contract: config.pbtxt, the Triton model's parser and
responses, and the clients (HTTP JSON, gRPC inputs, as the CLI and the serve benchmark call them) all agree
with it. The Triton model runs here with a stand-in for `triton_python_backend_utils`; no server needed."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import sys
import types
from typing import Any

import numpy as np
import pytest

from pipeline.serving import schema
from tests._utils.triton_stub import PROMPT, FakeCounter, FakeError, FakeRequest, FakeSession, arr


def refusal(model, inputs: dict[str, np.ndarray], parameters: dict | None = None) -> str:
    """The error message the model answers the request with (it must answer with one, of kind
    invalid_request)."""
    from pipeline.serving.error_kinds import ErrorKind, from_wire

    req = FakeRequest(inputs, parameters)
    model.execute([req])
    assert model.core.inbox.empty(), "the request was accepted"
    ((response, flags),) = req.sender.sent
    assert flags == 1 and response.error.code == FakeError.INVALID_ARG
    kind, message = from_wire(response.error.message)
    assert kind is ErrorKind.INVALID_REQUEST
    return message


# ---- config.pbtxt ------------------------------------------------------------------------------------
def test_config_pbtxt_tensors_are_the_schema():
    pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'dgpipe[serve]'")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from pipeline.limits import Limits
    from pipeline.serving.repository import model_config

    limits = Limits(max_batch=8, max_tokens=512, max_prompt=100)
    cfg = model_config("dgpipe", limits, "auto", {"text_input": "Hello", "max_tokens": 82})
    cfg = text_format.Parse(text_format.MessageToString(cfg), mc.ModelConfig())
    assert [(i.name, mc.DataType.Name(i.data_type), tuple(i.dims), i.optional) for i in cfg.input] == [
        (t.name, t.config_type, t.dims, t.optional) for t in schema.INPUTS
    ]
    assert [(o.name, mc.DataType.Name(o.data_type), tuple(o.dims)) for o in cfg.output] == [
        (t.name, t.config_type, t.dims) for t in schema.OUTPUTS
    ]
    from tritonclient.utils import triton_to_np_dtype

    for t in (*schema.INPUTS, *schema.OUTPUTS):  # the config type, the wire type and numpy's: Triton's triple
        assert t.config_type == "TYPE_" + ("STRING" if t.datatype == "BYTES" else t.datatype)
        assert np.dtype(t.numpy_dtype) == np.dtype(triton_to_np_dtype(t.datatype)), t.name
    warm = cfg.model_warmup[0].inputs
    assert {n: mc.DataType.Name(w.data_type) for n, w in warm.items()} == {
        "text_input": "TYPE_STRING",
        "max_tokens": "TYPE_INT32",
    }


def test_warmup_files_are_what_triton_reads():
    assert schema.raw_bytes("text_input", "Hé") == b"\x03\x00\x00\x00H\xc3\xa9"
    assert schema.raw_bytes("max_tokens", 82) == b"\x52\x00\x00\x00"


# ---- the Triton model's parser -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "inputs, parameters, message",
    [
        ({"max_tokens": arr("max_tokens", 82)}, None, "input 'text_input' or 'messages' is required"),
        ({"text_input": arr("text_input", "   ")}, None, "input 'text_input' is empty"),
        (
            {"text_input": arr("text_input", b"\xff\xfe")},
            None,
            "input 'text_input' is not valid UTF-8 (invalid start byte at byte 0)",
        ),
        (
            {"text_input": arr("text_input", "a", "b")},
            None,
            "input 'text_input' must hold exactly one value (got 2)",
        ),
        (
            {"text_input": arr("text_input", PROMPT), "max_tokens": arr("max_tokens", 0)},
            None,
            "input 'max_tokens' must be >= 1 (got 0)",
        ),
        (
            {"text_input": arr("text_input", PROMPT), "max_tokens": arr("max_tokens", 100_000)},
            None,
            "input 'max_tokens' is 100000, over this server's limit of 512",
        ),
        (
            {"text_input": arr("text_input", PROMPT), "entropy_bound": arr("entropy_bound", -1.0)},
            None,
            "input 'entropy_bound' must be in [0.001, 1e+06] (got -1)",
        ),
        (
            {
                "text_input": arr("text_input", PROMPT),
                "confidence_threshold": arr("confidence_threshold", -0.5),
            },
            None,
            "input 'confidence_threshold' must be in [0, 100] (got -0.5)",
        ),
        (
            {"text_input": arr("text_input", PROMPT), "stream": arr("stream", True, False)},
            None,
            "input 'stream' must hold exactly one value (got 2)",
        ),
        (
            {"text_input": arr("text_input", PROMPT), "stop_words": arr("stop_words", "ok", b"\xc3")},
            None,
            "input 'stop_words' is not valid UTF-8 (unexpected end of data at byte 0)",
        ),
        (
            {"text_input": arr("text_input", PROMPT)},
            {"temperature_schedule": "cosine", "beam": 2},
            "unknown parameter(s): beam, temperature_schedule",
        ),
    ],
)
def test_model_refuses_bad_requests_with_todays_messages(model, inputs, parameters, message):
    assert refusal(model, inputs, parameters) == message


def with_prompt(**values) -> dict[str, np.ndarray]:
    """The prompt plus each value as its input's wire array (UINT64, FP32, ... as Triton hands them over)."""
    return {"text_input": arr("text_input", PROMPT), **{n: arr(n, v) for n, v in values.items()}}


@pytest.mark.parametrize(
    "values, message",
    [  # the values that reached the runtime before: each poisoned its batch slot or failed the batch
        (
            {"t_min": 1e-45, "t_max": 1e-45},
            "input 't_min' must be in [0.001, 100] (got 1.401298e-45)",
        ),
        ({"t_min": 0.5, "t_max": 1e39}, "input 't_max' must be in [0.001, 100] (got inf)"),
        ({"t_max": float("nan")}, "input 't_max' must be in [0.001, 100] (got nan)"),
        ({"t_min": 0.0}, "input 't_min' must be in [0.001, 100] (got 0)"),
        ({"t_min": 0.75, "t_max": 0.5}, "input 't_min' (0.75) must be <= input 't_max' (0.5)"),
        ({"entropy_bound": float("inf")}, "input 'entropy_bound' must be in [0.001, 1e+06] (got inf)"),
        (
            {"confidence_threshold": 1e30},
            "input 'confidence_threshold' must be in [0, 100] (got 1e+30)",
        ),
        (
            {"seed": 2**63},
            "input 'seed' must be in [0, 9223372036854775807] (the sampler's seed range) (got 9223372036854775808)",
        ),
        ({"seed": 2**64 - 1}, "input 'seed' must be in [0, 9223372036854775807] (the sampler's seed range)"),
        (
            {"max_denoising_steps": 10**6},
            "input 'max_denoising_steps' is 1000000, over this server's limit of 64",
        ),
        ({"max_tokens": 2**31 - 1}, "input 'max_tokens' is 2147483647, over this server's limit of 512"),
        ({"timeout_s": 0.0}, "input 'timeout_s' must be a positive number of seconds (got 0)"),
        ({"timeout_s": float("nan")}, "input 'timeout_s' must be a positive number of seconds (got nan)"),
        ({"timeout_s": 61.0}, "input 'timeout_s' is 61.0, over this server's limit of 60.0"),
    ],
)
def test_model_refuses_values_outside_their_real_range(model, values, message):
    assert refusal(model, with_prompt(**values)).startswith(message)


def test_model_accepts_the_edges_of_each_range(model):
    edges = {"t_min": 0.001, "t_max": 100.0, "confidence_threshold": 0.0, "entropy_bound": 1e6}
    edges |= {"seed": 2**63 - 1, "max_denoising_steps": 64, "max_tokens": 512}
    model.execute([FakeRequest(with_prompt(**edges))])
    _, request = model.core.inbox.get_nowait()
    assert request.seed == 2**63 - 1 and request.max_tokens == 512
    assert request.sampler.max_denoising_steps == 64 and request.sampler.t_max == 100.0


def test_prompt_over_the_servers_limit_is_refused(model):
    inputs = {"text_input": arr("text_input", "1" * 101)}
    assert refusal(model, inputs) == "prompt has 101 tokens, over this server's limit of 100"


def test_a_prompt_over_the_byte_cap_is_refused_before_it_is_decoded_or_tokenized(model, monkeypatch):
    """max_prompt_bytes is checked on the raw tensors: a 10 MiB prompt never reaches the tokenizer (nor
    the chat template), so the model's request thread (and its health pings) is not held by it."""
    from pipeline.limits import DEFAULTS, request_bytes_limit

    cap = DEFAULTS.max_prompt_bytes
    assert model.core.limits.max_prompt_bytes == cap
    touched: list[str] = []
    for name in ("encode_prompt", "encode_messages"):
        monkeypatch.setattr(model.core.session, name, lambda *a, name=name: touched.append(name) or [1])
    big = b"x" * (10 << 20)
    assert refusal(model, {"text_input": arr("text_input", big)}) == (
        f"input 'text_input' holds {len(big)} bytes of prompt, over this server's limit of {cap} bytes "
        "(max_prompt_bytes): send a shorter prompt"
    )
    messages = json.dumps([{"role": "user", "content": "x" * (10 << 20)}]).encode()
    assert refusal(model, {"messages": arr("messages", messages)}).startswith(
        f"input 'messages' is {len(messages)} bytes of JSON, more than a prompt within this server's "
        f"limit of {cap} bytes (max_prompt_bytes) can take"
    )
    # JSON within the bound whose text is not: the text's bytes are counted once parsed
    assert len(escaped := json.dumps([{"role": "user", "content": "\x01" * cap}]).encode()) < (
        request_bytes_limit(cap)
    )
    assert "bytes of text prompt, over this server's limit" in refusal(
        model, {"messages": arr("messages", escaped)}
    )
    assert touched == []
    # at the cap: accepted and tokenized
    model.execute([FakeRequest({"text_input": arr("text_input", b"y" * cap)})])
    assert touched == ["encode_prompt"]


def test_stop_words_infill_templates_and_tools_are_bounded_before_they_are_read(model):
    """Each is read on the thread that answers health pings (a stop word searched after every canvas on the
    runtime loop): one 2 MB stop word held the loop past the watchdog's limit, and an empty one emptied the
    output. Refused from the raw tensors, naming the input and the cap."""
    from pipeline.limits import DEFAULTS, STOP_WORD_BYTES_MAX, STOP_WORDS_MAX, request_bytes_limit

    cap = DEFAULTS.max_prompt_bytes
    assert refusal(model, with_prompt(stop_words="")) == (
        "input 'stop_words' holds an empty string, which would match at once: leave it out"
    )
    words = [f"w{i}" for i in range(STOP_WORDS_MAX + 1)]
    assert refusal(
        model, {"text_input": arr("text_input", PROMPT), "stop_words": arr("stop_words", *words)}
    ) == (f"input 'stop_words' holds {STOP_WORDS_MAX + 1} words; at most {STOP_WORDS_MAX} are allowed")
    long = "x" * (STOP_WORD_BYTES_MAX + 1)
    assert refusal(
        model, {"text_input": arr("text_input", PROMPT), "stop_words": arr("stop_words", "ab", long)}
    ) == (f"input 'stop_words' holds a word of {len(long)} bytes; at most {STOP_WORD_BYTES_MAX} are allowed")
    big = "_" * (cap + 1)
    assert refusal(model, with_prompt(infill_template=big)) == (
        f"input 'infill_template' is {len(big)} bytes, over this server's limit of {cap} bytes"
    )
    tools = "[" + " " * request_bytes_limit(cap) + "]"
    assert refusal(model, with_prompt(tools=tools)) == (
        f"input 'tools' is {len(tools)} bytes, over this server's limit of {request_bytes_limit(cap)} bytes"
    )
    # at the caps: accepted
    at_cap = [f"{i:02d}" + "x" * (STOP_WORD_BYTES_MAX - 2) for i in range(STOP_WORDS_MAX)]
    req = FakeRequest({"text_input": arr("text_input", PROMPT), "stop_words": arr("stop_words", *at_cap)})
    model.execute([req])
    assert not req.sender.sent  # queued for the runtime, not refused


def test_messages_holding_a_lone_surrogate_are_refused_naming_it(model):
    messages = json.dumps([{"role": "user", "content": "a\ud800b"}]).encode()  # JSON's escape of it
    assert refusal(model, {"messages": arr("messages", messages)}) == (
        "input 'messages' is not valid: input 'messages'[0].content holds '\\ud800' at character 1, a lone "
        "surrogate that is not valid Unicode: send text whose surrogates come in pairs"
    )


def test_sampler_config_checks_the_same_ranges():
    """The in-process path (`dgpipe generate`) refuses what the server refuses: one table of ranges."""
    from pipeline.errors import SamplerError
    from pipeline.model.config import SAMPLER_RANGES, SamplerConfig

    for name, (lo, hi) in SAMPLER_RANGES.items():
        for bad in (lo / 2 if lo else -1.0, hi * 2, float("nan"), float("inf")):
            knobs = {"t_min": 0.001, "t_max": 100.0, name: bad}
            with pytest.raises(SamplerError, match=re.escape(f"{name} must be in [{lo:g}, {hi:g}]")):
                SamplerConfig(**knobs)


class FailingRuntime:
    """A runtime whose submit refuses seed 13 (as the runtime's own check would); the rest go through."""

    canvas_length, max_len = 32, 4096

    def __init__(self) -> None:
        self.submitted: list = []
        self.cancelled: list = []
        self.waiting: tuple = ()

    def validate(self, req) -> None:
        pass

    def submit(self, req) -> None:
        if req.seed == 13:
            raise ValueError("Overflow when unpacking long long")
        self.submitted.append(req)

    def busy(self) -> bool:
        return False

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)


def test_a_request_that_fails_in_the_worker_is_answered_alone(model, monkeypatch):
    """A failure that belongs to one request (its submission, its callbacks) answers that request with the
    error; the requests around it are submitted and their callbacks keep running."""
    import threading
    import time

    model.core.runtime = FailingRuntime()
    model.core.jobs = {}
    logged: list[str] = []
    monkeypatch.setattr(
        sys.modules["triton_python_backend_utils"],
        "Logger",
        types.SimpleNamespace(log_error=logged.append),
        raising=False,
    )
    reqs = [FakeRequest(with_prompt(seed=s)) for s in (1, 13, 2)]
    model.execute(reqs)
    model.core.running = True
    worker = threading.Thread(target=model.core.loop.run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 120  # the worker imports torch first
    while len(model.core.runtime.submitted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    model.core.running = False
    worker.join(5)
    assert [r.seed for r in model.core.runtime.submitted] == [1, 2] and set(model.core.jobs) == {1, 3}
    assert not reqs[0].sender.sent and not reqs[2].sender.sent
    ((response, flags),) = reqs[1].sender.sent
    assert flags == 1 and "Overflow when unpacking long long" in response.error.message

    # a callback that fails (here: decoding) fails its own request and cancels it in the runtime
    model.core.jobs[1].output.decode = lambda tokens: (_ for _ in ()).throw(
        UnicodeDecodeError("utf-8", b"", 0, 1, "bad")
    )
    first = model.core.runtime.submitted[0]
    first.on_canvas(first, [1, 2])
    assert model.core.runtime.cancelled == [1] and 1 not in model.core.jobs
    ((response, flags),) = reqs[0].sender.sent
    assert flags == 1 and "internal error in this request: UnicodeDecodeError" in response.error.message
    first.on_finish(types.SimpleNamespace(finish_reason="cancelled"))  # the runtime's cancel: nothing more
    assert len(reqs[0].sender.sent) == 1 and not reqs[2].sender.sent and 3 in model.core.jobs


@pytest.mark.parametrize("spec", [t for t in schema.INPUTS if t.rule is not None], ids=lambda t: t.name)
def test_model_refuses_each_rule_breach_with_the_schemas_message(model, spec):
    bad = next(v for v in ("   ", 0, -1, 0.0, -1.0) if _fits(spec, v) and not spec.rule.check(v))
    dtype = np.int64 if spec.datatype == "UINT64" else spec.numpy_dtype  # a uint64 is never negative
    value = arr(spec.name, bad) if spec.datatype == "BYTES" else np.array([bad], dtype=dtype)
    inputs = {"text_input": arr("text_input", PROMPT), spec.name: value}
    assert refusal(model, inputs) == spec.rule.error(spec.name, bad)


def _fits(spec: schema.TritonTensor, v: Any) -> bool:
    if spec.datatype == "BYTES" or isinstance(v, str):
        return spec.datatype == "BYTES" and isinstance(v, str)
    return isinstance(v, float) == spec.datatype.startswith("FP")


def test_model_accepts_every_input_and_applies_the_schemas_defaults(model):
    req = FakeRequest({"text_input": arr("text_input", PROMPT)})
    model.execute([req])
    job, request = model.core.inbox.get_nowait()
    assert request.max_tokens == schema.INPUT["max_tokens"].default and request.seed == 0
    assert job.flags == dict.fromkeys(schema.FLAGS, False) and job.output.stop_words == []
    assert model.core.session.knobs == {} and request.template == "default"
    assert job.timeout_s == 60.0  # the server's limit
    assert request.min_tokens == 0  # an end token stops it
    assert request.logprobs is None  # no log-probabilities unless asked

    values = {
        "max_tokens": 82,
        "stream": True,
        "seed": 7,
        "stop_words": ["9", "x"],
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "max_denoising_steps": 5,
        "entropy_bound": 0.5,
        "confidence_threshold": 0.25,
        "t_min": 0.5,
        "t_max": 1.0,
        "stream_drafts": True,
        "infill_template": "_" * 81,
        "timeout_s": 2.5,
        "guided_decoding_guide_type": "regex",
        "guided_decoding_guide": "[1-9]{81}",
        "ignore_eos": True,
        "min_tokens": 3,
        "return_log_probs": True,
        "top_logprobs": 4,
    }
    # every input is exercised (the tools, which need messages, in the next test)
    assert set(values) | {"text_input", "messages", "tools", "tool_choice"} == set(schema.INPUT)
    inputs = {"text_input": arr("text_input", PROMPT)}
    inputs |= {n: schema.input_array(n, v) for n, v in values.items()}
    req = FakeRequest(inputs)
    model.execute([req])  # a guided request is taken in off the execute thread (its guide may compile)
    job, request = model.core.inbox.get(timeout=10)
    assert not req.sender.sent
    assert (request.max_tokens, request.seed, job.output.stop_words) == (82, 7, ["9", "x"])
    assert job.flags == {f: True for f in schema.FLAGS} and request.on_draft is not None
    knobs = {t.name for t in schema.INPUTS if t.sampler}
    assert model.core.session.knobs == {k: values[k] for k in knobs}
    assert request.template == "template:" + "_" * 81
    assert job.timeout_s == 2.5
    assert request.guide == ("regex", "[1-9]{81}")
    assert request.min_tokens == 82  # ignore_eos: no end token stops it before max_tokens
    assert request.logprobs == 4


def test_min_tokens_stops_end_tokens_until_then_and_must_fit_max_tokens(model):
    req = FakeRequest(
        {
            "text_input": arr("text_input", PROMPT),
            **{n: schema.input_array(n, v) for n, v in {"max_tokens": 9, "min_tokens": 4}.items()},
        }
    )
    model.execute([req])
    _, request = model.core.inbox.get_nowait()
    assert request.min_tokens == 4
    req = FakeRequest(
        {
            "text_input": arr("text_input", PROMPT),
            **{n: schema.input_array(n, v) for n, v in {"max_tokens": 9, "min_tokens": 10}.items()},
        }
    )
    model.execute([req])
    ((response, _),) = req.sender.sent
    assert "input 'min_tokens' (10) must be <= max_tokens (9)" in response.error.message


def test_model_takes_messages_instead_of_text_input(model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    model.core.limits = dataclasses.replace(
        model.core.limits, max_prompt=200
    )  # the conversation is longer than a puzzle
    req = FakeRequest({"messages": arr("messages", json.dumps(messages))})
    model.execute([req])
    assert not req.sender.sent
    job, request = model.core.inbox.get_nowait()
    assert (
        job.prompt_ids
        == request.prompt_ids
        == model.core.session.encode_prompt(model.core.session.render(messages))
    )
    assert schema.request_body(None, 8, False, 0, {"messages": "[]"}).keys() == {
        "messages",
        "max_tokens",
        "seed",
        "stream",
    }


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {"text_input": arr("text_input", PROMPT), "messages": arr("messages", "[]")},
            "inputs 'text_input' and 'messages' exclude each other: send one",
        ),
        ({"messages": arr("messages", "[{")}, "input 'messages' is not valid: messages: not valid JSON"),
        ({"messages": arr("messages", "[]")}, "input 'messages' is not valid: messages: the list is empty"),
        (
            {"messages": arr("messages", '[{"role": "bot", "content": "x"}]')},
            "input 'messages' is not valid: messages[0]: unknown role 'bot'",
        ),
        (
            {"messages": arr("messages", '[{"role": "system", "content": "x"}]')},
            "input 'messages' is not valid: messages: there is no user message",
        ),
    ],
)
def test_model_refuses_bad_messages_naming_the_problem(model, inputs, message):
    assert refusal(model, inputs).startswith(message)


@pytest.mark.parametrize("chat", [False, True])
def test_model_echoes_the_prompt_it_read_for_text_and_messages(model, chat):
    """With exclude_input_in_output off the final text is the prompt as the model read it (for messages: the
    rendered template), then the answer; with it on, the answer alone."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    prompt_in = (
        {"messages": arr("messages", json.dumps(messages))}
        if chat
        else {"text_input": arr("text_input", PROMPT)}
    )
    echoed = FakeSession.render(messages) if chat else PROMPT
    model.core.jobs, model.core.metrics.steps, model.core.metrics.steps_per_canvas = (
        {},
        FakeCounter(),
        FakeCounter(),
    )
    model.core.limits = dataclasses.replace(model.core.limits, max_prompt=200)
    for exclude, want in ((False, echoed + "ANSWER"), (True, "ANSWER")):
        req = FakeRequest({**prompt_in, "exclude_input_in_output": arr("exclude_input_in_output", exclude)})
        model.execute([req])
        job, _ = model.core.inbox.get_nowait()
        job.output.add([ord(c) for c in "ANSWER"])  # what the canvases committed
        model.core.progress.on_finish(job, types.SimpleNamespace(finish_reason="stop", steps_per_canvas=[2]))
        ((response, flag),) = req.sender.sent
        outs = {t.name: t.arr for t in response.output_tensors}
        assert flag == 1 and outs["text_output"].tolist() == [want.encode()]


def test_model_responses_are_schema_outputs(model):
    flags = (
        "return_num_input_tokens",
        "return_num_output_tokens",
        "exclude_input_in_output",
        "return_log_probs",
    )
    req = FakeRequest({"text_input": arr("text_input", PROMPT), **{f: arr(f, True) for f in flags}})
    model.execute([req])
    job, _ = model.core.inbox.get_nowait()
    job.output.add([ord(c) for c in "done"])
    job.channel.send(model.core.progress.final(job, "stop", [3, 4]))
    ((response, flag),) = req.sender.sent
    outs = {t.name: t.arr for t in response.output_tensors}
    # a final response with the counts and log-probabilities: all of them
    assert flag == 1 and set(outs) == set(schema.OUTPUT)
    for name, a in outs.items():
        assert a.dtype == np.dtype(schema.OUTPUT[name].numpy_dtype), name
        assert a.shape == (1,) or schema.OUTPUT[name].is_list, name
    assert outs["text_output"].tolist() == [b"done"] and outs["denoise_steps"].tolist() == [3, 4]


# ---- the clients --------------------------------------------------------------------------------------
def _check_json_field(name: str, value: Any) -> None:
    spec = schema.INPUT[name]  # KeyError: the client sends a field the model does not have
    items = value if spec.is_list else [value]
    assert isinstance(items, list), name
    for v in items:
        if spec.datatype == "BYTES":
            assert isinstance(v, str), name
        elif spec.datatype == "BOOL":
            assert isinstance(v, bool), name
        elif spec.datatype.startswith("FP"):
            assert isinstance(v, int | float) and not isinstance(v, bool), name
        else:
            assert isinstance(v, int) and not isinstance(v, bool), name


def _final_outputs() -> dict[str, np.ndarray]:
    """One final response carrying every output the schema declares."""
    values = {
        "text_output": ["81 digits"],
        "num_input_tokens": [81],
        "num_cached_tokens": [64],
        "num_output_tokens": [82],
        "finish_reason": ["stop"],
        "denoise_steps": [3, 4],
        "logprobs": [json.dumps([{"token": "8", "logprob": -0.5, "bytes": [56], "top_logprobs": []}])],
    }
    assert set(values) == set(schema.OUTPUT)
    return {n: schema.output_array(n, v) for n, v in values.items()}


@pytest.fixture
def transports(monkeypatch):
    """Fake HTTP and gRPC transports: record what the client sends, answer with every schema output."""
    import urllib.request

    sent: dict[str, Any] = {}

    def urlopen(req, timeout=None):
        sent["http"] = json.loads(req.data)
        event = {
            n: a.tolist() if a.dtype != object else [x.decode() for x in a]
            for n, a in _final_outputs().items()
        }
        return io.BytesIO(f"data: {json.dumps(event)}\n\n".encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)

    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

    class Result:
        def __init__(self, outputs: dict[str, np.ndarray]) -> None:
            self.outputs = outputs

        def get_response(self):
            final = types.SimpleNamespace(bool_param=True)
            outs = [types.SimpleNamespace(name=n) for n in self.outputs]
            return types.SimpleNamespace(outputs=outs, parameters={"triton_final_response": final})

        def as_numpy(self, name: str) -> np.ndarray:
            return self.outputs[name]

    class Client:
        def __init__(self, url: str) -> None:
            pass

        def start_stream(self, callback) -> None:
            self.callback = callback

        def async_stream_infer(self, model, inputs, enable_empty_final_response=False) -> None:
            sent["grpc"] = inputs
            self.callback(Result(_final_outputs()), None)

        def stop_stream(self, cancel_requests: bool = False) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(tritonclient_grpc, "InferenceServerClient", Client)
    return sent


def _check_grpc_inputs(inputs) -> None:
    for t in inputs:
        spec = schema.INPUT[t.name()]
        assert t.datatype() == spec.datatype, t.name()
        assert t.shape() == [1] or spec.is_list, (t.name(), t.shape())


LOAD_TOOL_INPUTS = ("ignore_eos", "min_tokens")
# the OpenAI frontend's: dgpipe generate prints no log-probabilities and sends no tools
LOGPROB_INPUTS = ("return_log_probs", "top_logprobs", "tools", "tool_choice")


@pytest.mark.parametrize("url", ["http://h:8000", "grpc://h:8001"])
def test_remote_generate_sends_schema_fields_and_reads_every_output(transports, url):
    from pipeline.runtime.batch import GenerateInput, GenerateSettings
    from pipeline.serving.remote import generate_remote

    knobs = {t.name: 0.5 for t in schema.INPUTS if t.sampler and t.datatype == "FP32"}
    overrides = {**knobs, "max_denoising_steps": 5, "stability_threshold": None}
    settings = GenerateSettings(
        max_tokens=82,
        sampler=overrides,
        seed=7,
        infill="_" * 81,
        guide=("regex", "[1-9]{81}"),
        stream=True,
        drafts=True,
    )
    out = generate_remote(url, GenerateInput(PROMPT), settings).as_dict()
    assert (out["text"], out["finish_reason"], out["steps_per_canvas"]) == ("81 digits", "stop", [3, 4])
    assert (out["prompt_tokens"], out["cached_tokens"], out["output_tokens"]) == (81, 64, 82)
    if url.startswith("http"):
        body = transports["http"]
        for name, value in body.items():
            _check_json_field(name, value)
        # all but stop words, messages (none given), timeout_s (the CLI leaves the deadline to the server)
        # and the load-tool and log-probability fields (the CLI has no option for them)
        assert set(body) == set(schema.INPUT) - {
            "stop_words",
            "messages",
            "timeout_s",
            *LOAD_TOOL_INPUTS,
            *LOGPROB_INPUTS,
        }
    else:
        _check_grpc_inputs(transports["grpc"])
        assert {t.name() for t in transports["grpc"]} == set(schema.INPUT) - {
            "stop_words",
            "messages",
            "timeout_s",
            *LOAD_TOOL_INPUTS,
            *LOGPROB_INPUTS,
        }


@pytest.mark.parametrize("url", ["http://h:8000", "grpc://h:8001"])
def test_client_sends_stop_words_as_a_list_and_bench_serve_uses_schema_fields(transports, url):
    from pipeline.bench.serve import _timed_request
    from pipeline.bench.workload import BenchRequest
    from pipeline.serving.client import complete

    reply = complete(url, PROMPT, stop_words=["9", "x"], stream=True)
    assert reply.text == "81 digits"
    if url.startswith("http"):
        assert transports["http"]["stop_words"] == ["9", "x"]
    else:
        from tritonclient.utils import deserialize_bytes_tensor

        (words,) = [t for t in transports["grpc"] if t.name() == "stop_words"]
        assert words.shape() == [2] and deserialize_bytes_tensor(words._get_content()).tolist() == [
            b"9",
            b"x",
        ]
    _timed_request(url, BenchRequest(PROMPT, max_tokens=82, answer_chars=81), 3)
    if url.startswith("http"):
        for name, value in transports["http"].items():
            _check_json_field(name, value)
    else:
        _check_grpc_inputs(transports["grpc"])


def test_load_gauges_follow_every_change_and_histograms_count_each_event(model):
    """Active/queued are set when a request is accepted and again when it is answered (0 when idle, not
    left at the last busy value); each canvas and request is observed once, before the final response."""
    reqs = [FakeRequest({"text_input": arr("text_input", PROMPT)}) for _ in range(2)]
    model.execute(reqs)
    metrics = model.core.metrics
    assert (metrics.active.value, metrics.queued.value) == (2, 2)  # both wait in the inbox
    jobs = [model.core.inbox.get_nowait()[0] for _ in reqs]
    model.core.jobs = {j.request_id: j for j in jobs}  # what the worker does after submitting them
    model.core.update_load()
    assert (model.core.metrics.active.value, model.core.metrics.queued.value) == (2, 0)
    model.core.session.decode = lambda tokens: "x" * len(tokens)
    for job in jobs:
        model.core.progress.on_canvas(job, [1, 2])
        model.core.progress.on_canvas(job, [3])
    finish = types.SimpleNamespace(finish_reason="length", steps_per_canvas=[5, 7])
    for i, job in enumerate(jobs):
        sent = []
        job.channel.sender.send = lambda resp, flags=0, sent=sent: sent.append(
            model.core.metrics.active.value
        )
        model.core.progress.on_finish(job, finish)
        assert sent == [1 - i]  # the gauge moved before the final response went out
    assert (model.core.metrics.active.value, model.core.metrics.queued.value) == (0, 0)
    assert (
        len(model.core.metrics.time_to_first_canvas.observed)
        == len(model.core.metrics.request_latency.observed)
        == 2
    )
    assert len(
        model.core.metrics.canvas_latency.observed
    ) == 4 and model.core.metrics.steps_per_canvas.observed == [5, 7, 5, 7]
    assert all(
        v >= 0
        for v in model.core.metrics.canvas_latency.observed + model.core.metrics.request_latency.observed
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"guided_decoding_guide": "[0-9]"}, "input 'guided_decoding_guide' needs 'guided_decoding_guide_type'"),
        ({"guided_decoding_guide_type": "regex"}, "input 'guided_decoding_guide_type' 'regex' needs 'guided_decoding_guide'"),
        ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": "x"}, "grammars and structural tags are not supported"),
    ],
)  # fmt: skip
def test_model_refuses_incomplete_guides(model, inputs, message):
    sent = {"text_input": arr("text_input", PROMPT)} | {n: arr(n, v) for n, v in inputs.items()}
    assert message in refusal(model, sent)


def test_model_takes_a_json_object_guide_without_guide_text(model):
    model.execute(
        [
            FakeRequest(
                {
                    "text_input": arr("text_input", PROMPT),
                    **{"guided_decoding_guide_type": arr("guided_decoding_guide_type", "json")},
                }
            )
        ]
    )
    _, request = model.core.inbox.get_nowait()
    assert request.guide == ("json", "")


def test_an_absent_max_tokens_is_the_default_within_the_servers_cap():
    """A request that does not ask (an OpenAI client without max_tokens) is never refused for the default."""
    sent = {"text_input": arr("text_input", "hi")}
    for cap, want in ((64, 64), (4096, schema.INPUT["max_tokens"].default)):
        limits = schema.ServerLimits(max_tokens=cap, max_steps=64, max_prompt=100)
        assert schema.parse_request(sent.get, {}, limits).max_tokens == want
    with pytest.raises(schema.BadRequest, match="over this server's limit of 64"):  # asked: refused
        schema.parse_request(
            {**sent, "max_tokens": arr("max_tokens", 65)}.get, {}, schema.ServerLimits(64, 64, 100)
        )


def test_an_absent_max_tokens_is_the_checkpoints_generation_default_within_the_cap(model):
    """generation_config.json's max_new_tokens is the default max_tokens (the schema's only without one),
    still within the server's cap; a request that asks keeps its own."""
    for default, want in ((82, 82), (1000, 512), (None, schema.INPUT["max_tokens"].default)):
        model.core.session.max_new_tokens = default
        model.execute([FakeRequest(with_prompt())])
        _, request = model.core.inbox.get_nowait()
        assert request.max_tokens == want, default
    model.core.session.max_new_tokens = 82
    model.execute([FakeRequest(with_prompt(max_tokens=300))])
    assert model.core.inbox.get_nowait()[1].max_tokens == 300


def test_an_asked_max_tokens_past_the_context_is_refused_naming_the_numbers(model):
    """The prompt's 81 tokens, max_tokens and two 32-token canvases must fit the runtime's context."""
    model.core.runtime.max_len = 200  # room for 200 - 81 - 64 = 55 tokens
    message = refusal(model, with_prompt(max_tokens=56))
    assert message == (
        "the prompt has 81 tokens and max_tokens is 56: together they need a 201-token context "
        "(prompt + max_tokens + two 32-token canvases), over this model's context of 200 tokens; "
        "ask for max_tokens <= 55"
    )
    model.execute([FakeRequest(with_prompt(max_tokens=55))])  # exactly fits
    assert model.core.inbox.get_nowait()[1].max_tokens == 55
    model.core.runtime.max_len = 81 + 64  # no room at all: the fix is a shorter prompt
    assert refusal(model, with_prompt(max_tokens=1)).endswith("; send a shorter prompt")


def test_the_default_max_tokens_is_shortened_to_what_the_context_holds(model):
    """Not asked: never refused for the context, the default (here the checkpoint's 300) cut to fit;
    ignore_eos then runs to that shortened max_tokens."""
    model.core.runtime.max_len = 200
    model.core.session.max_new_tokens = 300
    model.execute([FakeRequest(with_prompt(ignore_eos=True))])
    _, request = model.core.inbox.get_nowait()
    assert request.max_tokens == 55 and request.min_tokens == 55


def test_a_request_the_client_cancelled_is_released_with_the_final_flag_and_no_response(model):
    """Triton keeps a cancelled request (and the model loaded) until the model sends the final flag."""
    req = FakeRequest(with_prompt())
    req.sender.is_cancelled = lambda: True
    model.execute([req])
    job, request = model.core.inbox.get_nowait()
    model.core.jobs[job.request_id] = job
    request.on_finish(types.SimpleNamespace(finish_reason="cancelled", steps_per_canvas=[]))
    assert req.sender.sent == [(None, 1)] and job.request_id not in model.core.jobs


# ---- the Triton model's side of the lifecycle (pipeline/serving/lifecycle.py is the other side) ----------
def test_model_answers_a_ping_from_its_runtime_loop_and_counts_no_request(model):
    req = FakeRequest({}, {schema.HEALTH_PARAMETER: True})
    model.execute([req])
    assert not req.sender.sent  # not answered by Triton's thread: by the loop
    assert model.core.pings.get_nowait().sender is req.sender
    # not a request, not in the load gauges
    assert model.core.inbox.empty() and model.core.metrics.requests.value == 0


def test_model_refuses_new_requests_once_the_drain_file_is_touched(model, tmp_path):
    import os
    import time

    from pipeline.serving import lifecycle
    from pipeline.serving.core.drain import DrainSignal

    drain = tmp_path / "draining"
    model.core.drain = DrainSignal(str(drain), time.time())
    drain.touch()
    loaded_at = model.core.drain.loaded_at
    os.utime(drain, (loaded_at - 60, loaded_at - 60))  # a previous container's file: ignored
    model.execute([FakeRequest({"text_input": arr("text_input", PROMPT)})])
    assert model.core.inbox.qsize() == 1
    lifecycle.touch_drain_file(drain)
    for req in (FakeRequest({"text_input": arr("text_input", PROMPT)}), FakeRequest({}, {"health_check": 1})):
        model.execute([req])
        ((response, flags),) = req.sender.sent
        assert flags == 1 and response.error.code == FakeError.UNAVAILABLE
        assert response.error.message == f"[unavailable] {schema.DRAINING}"
    assert model.core.inbox.qsize() == 1 and model.core.metrics.draining.value == 1


def test_a_request_past_its_deadline_is_answered_with_an_error_naming_it(model):
    import time

    logged: list[str] = []
    model.core.log_error = logged.append
    model.execute(
        [FakeRequest({"text_input": arr("text_input", PROMPT), "timeout_s": arr("timeout_s", 2.0)})]
    )
    job, _ = model.core.inbox.get_nowait()
    now = time.perf_counter()
    assert not job.overdue(now + 100)  # queued: time in the queue does not count
    job.result = types.SimpleNamespace(admitted=now)
    assert not job.overdue(now + 1.9) and job.overdue(now + 2.1)
    cancelled = []
    model.core.runtime.cancel = cancelled.append
    model.core.jobs[job.request_id] = job
    job.expired = True
    model.core.progress.on_finish(job, types.SimpleNamespace(finish_reason="cancelled", steps_per_canvas=[]))
    ((response, flags),) = job.channel.sender.sent
    assert flags == 1 and response.error.code == FakeError.UNAVAILABLE
    assert response.error.message.startswith("[timeout] request ran past its deadline of 2 s")
    assert "60 s" in response.error.message
    assert model.core.metrics.expired.value == 1 and not model.core.jobs and "past its deadline" in logged[0]


def test_finalize_answers_every_queued_and_in_flight_request_as_unavailable(model):
    """Unloading the model (Triton's finalize) must not leave a client waiting: a request still queued and
    one in the batch are both answered with the shutting-down error, and a request after it is refused."""
    from pipeline.serving.core.shutdown import SHUTTING_DOWN

    dropped: list = []
    model.core.runtime.drop_all = lambda: dropped.append(True)
    queued, running, late = (FakeRequest(with_prompt(seed=s)) for s in (1, 2, 3))
    model.execute([queued, running])
    job, _ = model.core.inbox.queue.pop()  # `running` got a batch slot
    model.core.jobs[job.request_id] = job
    model.finalize()
    model.execute([late])
    for req in (queued, running, late):
        ((response, flags),) = req.sender.sent
        assert flags == 1 and response.error.code == FakeError.UNAVAILABLE
        assert response.error.message == f"[unavailable] {SHUTTING_DOWN}"
    assert model.core.inbox.empty() and not model.core.jobs and dropped == [True]
    assert (model.core.metrics.active.value, model.core.metrics.queued.value) == (0, 0)


def test_tools_reach_the_chat_template_and_auto_needs_a_declared_tool_call_format(model):
    import json

    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = json.dumps([{"role": "user", "content": "hi"}])

    def send(**values):
        req = FakeRequest({n: schema.input_array(n, v) for n, v in {"messages": messages, **values}.items()})
        model.execute([req])
        return req

    assert not send(tools=json.dumps(tools)).sender.sent
    model.core.inbox.get_nowait()
    assert model.core.session.tools == tools
    ((response, _),) = send(tools=json.dumps(tools), tool_choice="auto").sender.sent
    assert (
        "tool_choice 'auto' needs a chat template that declares a tool-call format" in response.error.message
    )
    model.core.session.tool_call_format = "hermes"
    assert not send(tools=json.dumps(tools), tool_choice="auto").sender.sent
    ((response, _),) = send(tool_choice="auto").sender.sent
    assert "input 'tool_choice' needs 'tools'" in response.error.message
    req = FakeRequest({"text_input": arr("text_input", PROMPT), "tools": schema.input_array("tools", "[]")})
    model.execute([req])
    assert "input 'tools' needs 'messages'" in req.sender.sent[0][0].error.message
