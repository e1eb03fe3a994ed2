"""The request/response contract of the dgpipe Triton model, written once: every tensor with its Triton and
numpy types, dims, default and validation rule. The repository builds config.pbtxt from it, the Triton model
parses and validates requests with it, and the clients build their HTTP JSON bodies and gRPC inputs with it.

Light on purpose (stdlib + numpy + the sampler's config, no torch): the Triton model imports it inside
tritonserver's Python stub. Names follow Triton's LLM conventions (`text_input`, `max_tokens`, `stream`:
the vLLM backend's layout, `max_batch_size: 0` and dims [1]), so Triton's `/generate` and `/generate_stream`
work and dgpipe's OpenAI frontend (pipeline/serving/openai_api.py) drives it. Triton's own OpenAI frontend
does not: it sends Python-backend models TensorRT-LLM's batched layout.

Every value is checked against its real range here, before the request is queued: nothing out of range
reaches the runtime's shared batch state. What this model cannot see: Triton's HTTP JSON parser converts a
value to the input's datatype before the model gets it, so an integer above INT32 arrives wrapped
(2**32 + 5 as 5) and JSON it cannot convert (a string for a number, 2**64) is answered by Triton itself with
a 500 "Unable to parse 'data'". gRPC carries typed tensors (a wrong datatype is refused naming the input).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.limits import (
    DEFAULT_MAX_TOKENS,
    DEFAULTS,
    STOP_WORD_BYTES_MAX,
    STOP_WORDS_MAX,
    TOP_LOGPROBS_MAX,
    request_bytes_limit,
)
from pipeline.limits import INT32_MAX as INT32_MAX  # what an INT32 input holds (re-exported)
from pipeline.model.config import SAMPLER_RANGES
from pipeline.runtime.chat_template import MessagesError, last_user_text, parse_messages  # stdlib only
from pipeline.sampler.constraints import GUIDE_TYPES  # numpy only until a guide is compiled

NUMPY_DTYPES: dict[str, Any] = {  # Triton datatype (wire name) -> numpy dtype
    "BYTES": np.object_,
    "BOOL": np.bool_,
    "INT32": np.int32,
    "UINT64": np.uint64,
    "FP32": np.float32,
}
KNOWN_PARAMETERS: frozenset[str] = frozenset()  # request parameters we accept (none yet): others are refused
# a request with this parameter is a health ping: answered by the model's runtime loop, no inputs needed
HEALTH_PARAMETER = "health_check"
# the file whose touch (after the model loaded) makes the model refuse new requests: `dgpipe serve` and
# the pod's preStop hook drain through it (pipeline/serving/lifecycle.py)
DRAIN_FILE_ENV = "DGPIPE_DRAIN_FILE"
# how the model's lifecycle refusals begin: the clients map them to 503 / 504 instead of a 400
DRAINING = "this server is draining (shutting down): retry on another replica"
PAST_DEADLINE = "request ran past its deadline"
QUEUE_FULL = (
    "this server's queue is full ({} requests wait for a batch slot): retry shortly or on another replica"
)


class BadRequest(ValueError):
    """A request the model refuses; the message goes back to the client as Triton's INVALID_ARG."""


@dataclass(frozen=True)
class Rule:
    """What a valid value is, and the message that completes "input '<name>' ..." when it is not."""

    check: Callable[[Any], bool]
    message: str
    show_value: bool = True  # append " (got <value>)"

    def error(self, name: str, value: Any) -> str:
        # a float input arrives as fp32: 7 significant digits read it as sent (0.0001, not 9.999999747e-05)
        shown = f"{value:.7g}" if isinstance(value, float) else value
        return f"input '{name}' {self.message}" + (f" (got {shown})" if self.show_value else "")


AT_LEAST_ONE = Rule(lambda v: v >= 1, "must be >= 1")
NOT_BLANK = Rule(lambda s: bool(s.strip()), "is empty", show_value=False)
SEED_MAX = (
    2**63 - 1
)  # the sampler keeps seeds in int64 slots and hashes all 63 bits (pipeline/sampler/rng.py)


def between(lo: float, hi: float) -> Rule:
    """lo <= value <= hi, inclusive; NaN and inf fail it."""
    return Rule(lambda v: lo <= v <= hi, f"must be in [{lo:g}, {hi:g}]")


def _sampler_range(name: str) -> Rule:
    return between(*SAMPLER_RANGES[name])


POSITIVE_SECONDS = Rule(lambda v: 0 < v < float("inf"), "must be a positive number of seconds")
GUIDE_TYPE = Rule(
    lambda v: v in GUIDE_TYPES,
    f"must be one of {', '.join(GUIDE_TYPES)} (EBNF grammars and structural tags are not supported)",
)
TOOL_CHOICE = Rule(lambda v: v in ("auto", "required"), "must be auto or required")
SEED_RANGE = Rule(lambda v: 0 <= v <= SEED_MAX, f"must be in [0, {SEED_MAX}] (the sampler's seed range)")


@dataclass(frozen=True)
class TritonTensor:
    name: str
    datatype: str  # Triton's wire datatype: a key of NUMPY_DTYPES
    dims: tuple[int, ...]  # (1,) one value, (-1,) any number
    doc: str
    optional: bool = True
    default: Any = None  # what an absent optional input means (None: the checkpoint's own setting)
    rule: Rule | None = None
    sampler: bool = False  # a diffusion knob, handed to the sampler (session.sampler(**knobs))

    @property
    def config_type(self) -> str:
        """The DataType name in config.pbtxt (model_config_pb2): BYTES is TYPE_STRING there."""
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"

    @property
    def numpy_dtype(self) -> Any:
        return NUMPY_DTYPES[self.datatype]

    @property
    def is_list(self) -> bool:
        return self.dims == (-1,)


def _in(name: str, datatype: str, doc: str, dims: tuple[int, ...] = (1,), **kw: Any) -> TritonTensor:
    return TritonTensor(name, datatype, dims, doc, **kw)


# config.pbtxt lists them in this order
INPUTS: tuple[TritonTensor, ...] = (
    # one of text_input and messages (parse_request checks that exactly one is sent)
    _in("text_input", "BYTES", "the prompt (UTF-8)", rule=NOT_BLANK),
    _in("max_tokens", "INT32", "tokens to generate at most", default=DEFAULT_MAX_TOKENS, rule=AT_LEAST_ONE),
    _in("stream", "BOOL", "send each committed canvas as it completes", default=False),
    # absent: 0, so a direct Triton request is reproducible (TensorRT-LLM's random_seed default); the OpenAI
    # frontend draws a fresh seed for a request without one (openai_schema.sampler_seed)
    _in("seed", "UINT64", "sampling seed: same seed, same answer", default=0, rule=SEED_RANGE),
    _in("stop_words", "BYTES", "stop at the first of these strings", dims=(-1,), default=()),
    _in("exclude_input_in_output", "BOOL", "return the generated text only", default=False),
    _in("return_num_input_tokens", "BOOL", "add num_input_tokens to the final response", default=False),
    _in("return_num_output_tokens", "BOOL", "add num_output_tokens to the final response", default=False),
    _in(
        "max_denoising_steps",
        "INT32",
        "denoise passes per canvas at most",
        rule=AT_LEAST_ONE,
        sampler=True,
    ),
    _in(
        "entropy_bound",
        "FP32",
        "adaptive stop: commit below this entropy",
        rule=_sampler_range("entropy_bound"),
        sampler=True,
    ),
    _in(
        "confidence_threshold",
        "FP32",
        "adaptive stop: confidence to commit",
        rule=_sampler_range("confidence_threshold"),
        sampler=True,
    ),
    _in("t_min", "FP32", "temperature schedule: last step", rule=_sampler_range("t_min"), sampler=True),
    _in("t_max", "FP32", "temperature schedule: first step", rule=_sampler_range("t_max"), sampler=True),
    _in("stream_drafts", "BOOL", "also send the canvas after every denoise step", default=False),
    _in("ignore_eos", "BOOL", "an end token does not stop generation: run to max_tokens", default=False),
    _in(
        "min_tokens",
        "INT32",
        "an end token does not stop generation before this many tokens",
        default=0,
        rule=Rule(lambda v: v >= 0, "must be >= 0"),
    ),
    # log-probabilities (TensorRT-LLM's return_log_probs): each returned token's, from the distribution of
    # the denoise pass that committed it, with its top_logprobs most probable alternatives (README, "logprobs")
    _in(
        "return_log_probs",
        "BOOL",
        "add each returned token's log-probability (output 'logprobs')",
        default=False,
    ),
    _in(
        "top_logprobs",
        "INT32",
        "with return_log_probs: the most probable alternatives per token",
        default=0,
        rule=between(0, TOP_LOGPROBS_MAX),
    ),
    # function tools (OpenAI's `tools`, JSON): rendered through the chat template; `tool_choice` "auto" lets
    # the model call them in its template's tool-call format, refused when the template declares none
    _in("tools", "BYTES", "with messages: OpenAI function tools as JSON, rendered by the chat template"),
    _in(
        "tool_choice",
        "BYTES",
        "with tools: auto (the model's own tool-call format) or required",
        rule=TOOL_CHOICE,
    ),
    _in("infill_template", "BYTES", "canvas template: '_' is free, other text is pinned"),
    _in(
        "messages",
        "BYTES",
        "instead of text_input: OpenAI-style chat messages as JSON, through the chat template",
    ),
    _in(
        "timeout_s",
        "FP32",
        "seconds this request may run once in the batch (the server's limit when absent), then ends with an error",
        rule=POSITIVE_SECONDS,
    ),
    # constrained decoding, under TensorRT-LLM's names (docs/constrained.md)
    _in(
        "guided_decoding_guide_type",
        "BYTES",
        f"constrained output: {', '.join(GUIDE_TYPES)}",
        rule=GUIDE_TYPE,
    ),
    _in(
        "guided_decoding_guide",
        "BYTES",
        "the guide: a JSON schema, a regular expression, or a JSON list of choices",
    ),
)
OUTPUTS: tuple[TritonTensor, ...] = (
    _in("text_output", "BYTES", "generated text (a piece per response when streaming)", dims=(-1,)),
    _in("num_input_tokens", "INT32", "prompt tokens (with return_num_input_tokens)"),
    _in(
        "num_cached_tokens",
        "INT32",
        "of the prompt tokens, those whose K/V the prefix cache held (with return_num_input_tokens)",
    ),
    _in("num_output_tokens", "INT32", "generated tokens (with return_num_output_tokens)"),
    _in("finish_reason", "BYTES", "why generation ended: stop, length, cancelled"),
    _in("denoise_steps", "INT32", "denoise steps per canvas (the step, for a draft)", dims=(-1,)),
    _in(
        "logprobs",
        "BYTES",
        "with return_log_probs: JSON list, per token of this response's text, of {token, logprob, bytes, "
        "top_logprobs}",
    ),
)
INPUT: dict[str, TritonTensor] = {t.name: t for t in INPUTS}
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")  # a request with either is guided
OUTPUT: dict[str, TritonTensor] = {t.name: t for t in OUTPUTS}
FLAGS = tuple(t.name for t in INPUTS if t.datatype == "BOOL")
PROMPT_INPUTS = ("text_input", "messages")  # exactly one per request


# ---- the Triton model's side: parse and validate a request -------------------------------------------
@dataclass(frozen=True)
class ServerLimits:
    """The caps one request may ask for, from the repository's config.pbtxt parameters (pipeline.limits'
    defaults when a parameter is missing)."""

    max_tokens: int  # max_tokens per request
    max_steps: int  # max_denoising_steps: denoise passes per canvas
    max_prompt: int  # prompt tokens (already within what the model's positions hold with one canvas)
    max_batch: int = DEFAULTS.max_batch  # rows of one denoise pass: requests beyond it wait for a slot
    max_queue: int = (
        DEFAULTS.max_queue
    )  # requests waiting for a slot: one more is refused at once (0: no cap)
    # how long a request may run once it has a batch slot: its deadline
    max_request_seconds: float = float("inf")
    max_prompt_bytes: int = DEFAULTS.max_prompt_bytes  # UTF-8 bytes of a prompt, checked before tokenizing
    max_guide_bytes: int = DEFAULTS.max_guide_bytes  # UTF-8 bytes of a guide, checked before compiling
    max_regex_positions: int = DEFAULTS.max_regex_positions  # a regex's unrolled positions, likewise
    max_guide_seconds: int = DEFAULTS.max_guide_seconds  # wall time compiling one guide may take
    max_guide_memory_mib: int = DEFAULTS.max_guide_memory_mib  # memory compiling one guide may take
    prefix_cache_mib: int = DEFAULTS.prefix_cache_mib  # K/V of prompt blocks kept across requests (0: off)


def prompt_limit(cap: int, max_positions: int, canvas_length: int) -> int:
    """The longest prompt a server admits: its cap, and at most what the model's positions hold with one
    canvas after it. One rule for `dgpipe package` (what it writes) and the Triton model (what it admits)."""
    return max(0, min(cap, max_positions - canvas_length))


@dataclass
class ParsedRequest:
    prompt: str
    max_tokens: int
    seed: int
    sampler: dict[str, int | float]  # the knobs the request sets, for session.sampler(**sampler)
    flags: dict[str, bool]  # every flag in FLAGS, absent = False
    stop_words: list[str] = field(default_factory=list)
    infill_template: str | None = None
    messages: list[dict[str, Any]] | None = None  # checked chat messages, when sent instead of text_input
    timeout_s: float = float("inf")  # the request's deadline (from its batch slot): its own or the server's
    guide: tuple[str, str] | None = None  # constrained decoding: (guide type, guide), compiled by the model
    min_tokens: int = 0  # end tokens do not stop generation before this many tokens (ignore_eos: max_tokens)
    logprobs: int | None = None  # return_log_probs: the top alternatives per token (top_logprobs); None: off
    tools: list[Any] | None = None  # function tools for the chat template (with messages only)
    tool_choice: str | None = None
    # whether the request sent max_tokens: one asked for is refused when it does not fit the context, the
    # default is shortened to what fits
    max_tokens_asked: bool = True


def _scalar(arr: np.ndarray, name: str) -> Any:
    if arr.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one value (got {arr.size})")
    return arr.reshape(-1)[0]


def _text(value: Any, name: str) -> str:
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"input '{name}' is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    return str(value)


def _value(spec: TritonTensor, arr: np.ndarray) -> Any:
    """One input's array as a Python value, checked against the spec's rule."""
    if spec.is_list:
        return [_text(w, spec.name) for w in arr.reshape(-1)]
    v = _scalar(arr, spec.name)
    if spec.datatype == "BYTES":
        v = _text(v, spec.name)
    elif spec.datatype == "BOOL":
        v = bool(v)
    else:
        v = float(v) if spec.datatype.startswith("FP") else int(v)
    if spec.rule is not None and not spec.rule.check(v):
        raise BadRequest(spec.rule.error(spec.name, v))
    return v


def parse_request(
    get: Callable[[str], np.ndarray | None],
    parameters: Mapping[str, Any],
    limits: ServerLimits,
    default_max_tokens: int | None = None,
) -> ParsedRequest:
    """The request's inputs (`get(name)`: the tensor's array, None when absent) as Python values, every
    one checked; the first problem raises BadRequest with the message the client sees.
    `default_max_tokens`: the checkpoint's generation default (generation_config.json's max_new_tokens),
    for a request that sends no max_tokens; None: the schema's default."""
    unknown = set(parameters) - KNOWN_PARAMETERS
    if unknown:
        raise BadRequest(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    _check_required(get)
    _check_input_bytes(get, limits.max_prompt_bytes)

    def read(kind: Callable[[TritonTensor], bool]) -> dict[str, Any]:
        out = {}
        for spec in INPUTS:
            if kind(spec):
                arr = get(spec.name)
                out[spec.name] = _value(spec, arr) if arr is not None else spec.default
        return out

    # the order of the checks decides which message a request with several problems gets: text, numbers,
    # the server's limits, flags, lists, then the other texts
    values = read(lambda s: not s.optional)
    values |= read(lambda s: s.datatype not in ("BYTES", "BOOL"))
    asked = get("max_tokens") is not None
    if not asked:  # the checkpoint's default (else the schema's), within this server's cap (never a refusal)
        default = values["max_tokens"] if default_max_tokens is None else default_max_tokens
        values["max_tokens"] = min(default, limits.max_tokens)
    _check_limits(values, limits)
    max_tokens = values["max_tokens"]
    if values["min_tokens"] > max_tokens:
        raise BadRequest(f"input 'min_tokens' ({values['min_tokens']}) must be <= max_tokens ({max_tokens})")
    flags = read(lambda s: s.datatype == "BOOL")
    values |= read(lambda s: s.optional and s.datatype == "BYTES")
    messages, prompt = (None, values["text_input"])
    if values["messages"] is not None:
        messages, prompt = _messages(values["messages"], limits.max_prompt_bytes)
    guide = _guide(values["guided_decoding_guide_type"], values["guided_decoding_guide"])
    tools = _tools(values["tools"], values["tool_choice"], messages)
    return ParsedRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        seed=values["seed"],
        sampler={t.name: values[t.name] for t in INPUTS if t.sampler and values[t.name] is not None},
        flags=flags,
        stop_words=list(values["stop_words"]),
        infill_template=values["infill_template"],
        messages=messages,
        timeout_s=values["timeout_s"] if values["timeout_s"] is not None else limits.max_request_seconds,
        guide=guide,
        min_tokens=max_tokens if flags["ignore_eos"] else values["min_tokens"],
        logprobs=_logprobs(values["top_logprobs"], flags["return_log_probs"]),
        tools=tools,
        tool_choice=values["tool_choice"],
        max_tokens_asked=asked,
    )


def _check_required(get: Callable[[str], np.ndarray | None]) -> None:
    """Every required input, and exactly one of the prompt inputs."""
    for spec in INPUTS:
        if not spec.optional and get(spec.name) is None:
            raise BadRequest(f"input '{spec.name}' is required")
    sent = [name for name in PROMPT_INPUTS if get(name) is not None]
    if len(sent) != 1:
        raise BadRequest(
            "input 'text_input' or 'messages' is required"
            if not sent
            else "inputs 'text_input' and 'messages' exclude each other: send one"
        )


def _check_limits(values: Mapping[str, Any], limits: ServerLimits) -> None:
    """The numbers against this server's caps, and the temperature schedule's order."""
    for name, limit in (
        ("max_tokens", limits.max_tokens),
        ("max_denoising_steps", limits.max_steps),
        ("timeout_s", limits.max_request_seconds),
    ):
        if values[name] is not None and values[name] > limit:
            raise BadRequest(f"input '{name}' is {values[name]}, over this server's limit of {limit}")
    if values["t_min"] is not None and values["t_max"] is not None and values["t_min"] > values["t_max"]:
        raise BadRequest(f"input 't_min' ({values['t_min']}) must be <= input 't_max' ({values['t_max']})")


def _guide(kind: str | None, guide: str | None) -> tuple[str, str] | None:
    """Both guide inputs or neither (`json`, any JSON object, needs no guide text)."""
    if kind is None:
        if guide is not None:
            raise BadRequest("input 'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    if guide is None and kind != "json":
        raise BadRequest(f"input 'guided_decoding_guide_type' {kind!r} needs 'guided_decoding_guide'")
    return kind, guide or ""


def _logprobs(top: int, wanted: bool) -> int | None:
    """The runtime's logprobs: None (not wanted), or the alternatives per token."""
    if top and not wanted:
        raise BadRequest("input 'top_logprobs' needs 'return_log_probs': true")
    return top if wanted else None


def _tools(raw: str | None, choice: str | None, messages: list | None) -> list[Any] | None:
    """The tools as a JSON list, sent with messages (a plain prompt has no chat template to render them)."""
    if raw is None:
        if choice is not None:
            raise BadRequest("input 'tool_choice' needs 'tools'")
        return None
    if messages is None:
        raise BadRequest("input 'tools' needs 'messages' (the chat template renders them)")
    try:
        tools = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"input 'tools' is not valid JSON ({e.msg})") from e
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("input 'tools' must be a JSON list of tool objects")
    return tools


def _messages(raw: str, max_prompt_bytes: int) -> tuple[list[dict[str, Any]], str]:
    """The checked messages and the last user message's text (what `prompt` means for a chat request);
    their text within the byte cap and valid Unicode (JSON can spell a lone surrogate, UTF-8 cannot)."""
    try:
        messages = parse_messages(raw)
        size = text_bytes(messages, "input 'messages'")
        if size > max_prompt_bytes:
            raise BadRequest(prompt_too_big("input 'messages'", size, max_prompt_bytes, "text "))
        return messages, last_user_text(messages)
    except (MessagesError, TextError) as e:
        raise BadRequest(f"input 'messages' is not valid: {e}") from e


class TextError(ValueError):
    """Text that is not valid Unicode: a lone surrogate, which JSON's \\uD800 escape can carry."""


def text_bytes(value: Any, where: str) -> int:
    """The UTF-8 bytes of every string (keys too) in a JSON value; TextError naming the first string UTF-8
    cannot encode. Iterative: a deeply nested value cannot exhaust the stack."""
    total, stack = 0, [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                total += len(item.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise TextError(
                    f"{at} holds {item[e.start]!r} at character {e.start}, a lone surrogate that is not "
                    "valid Unicode: send text whose surrogates come in pairs"
                ) from None
        elif isinstance(item, dict):
            stack.extend((k, at) for k in item)
            stack.extend((v, f"{at}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return total


def prompt_too_big(what: str, size: int, limit: int, kind: str = "") -> str:
    """The refusal of a prompt over the byte cap, naming the cap and the fix."""
    return (
        f"{what} holds {size} bytes of {kind}prompt, over this server's limit of {limit} bytes "
        "(max_prompt_bytes): send a shorter prompt"
    )


def _check_input_bytes(get: Callable[[str], np.ndarray | None], max_prompt_bytes: int) -> None:
    """The text inputs' sizes, from the raw tensors before anything is decoded, parsed or tokenized:
    `text_input` within the byte cap, `messages` (JSON: its text is checked once parsed) within what a
    prompt at the cap takes as JSON, then the other texts (`_check_text_inputs`)."""
    for name in PROMPT_INPUTS:
        arr = get(name)
        if arr is None:
            continue
        size = sum(len(v) if isinstance(v, bytes | str) else 0 for v in arr.reshape(-1))
        if name == "text_input" and size > max_prompt_bytes:
            raise BadRequest(prompt_too_big("input 'text_input'", size, max_prompt_bytes))
        if name == "messages" and size > request_bytes_limit(max_prompt_bytes):
            raise BadRequest(
                f"input 'messages' is {size} bytes of JSON, more than a prompt within this server's limit "
                f"of {max_prompt_bytes} bytes (max_prompt_bytes) can take: send a shorter prompt"
            )
    _check_text_inputs(get, max_prompt_bytes)


def _check_text_inputs(get: Callable[[str], np.ndarray | None], max_prompt_bytes: int) -> None:
    """The other texts' sizes, from the raw tensors before they are decoded, tokenized or parsed on the thread
    that also answers health pings: the stop words within their caps and none empty (it would match at
    once), an infill template within the prompt's byte cap, the tools within what a request body takes."""
    words = get("stop_words")
    if words is not None:
        sizes = [len(w) if isinstance(w, bytes | str) else 0 for w in words.reshape(-1)]
        if len(sizes) > STOP_WORDS_MAX:
            raise BadRequest(
                f"input 'stop_words' holds {len(sizes)} words; at most {STOP_WORDS_MAX} are allowed"
            )
        if 0 in sizes:
            raise BadRequest(
                "input 'stop_words' holds an empty string, which would match at once: leave it out"
            )
        if max(sizes, default=0) > STOP_WORD_BYTES_MAX:
            raise BadRequest(
                f"input 'stop_words' holds a word of {max(sizes)} bytes; at most {STOP_WORD_BYTES_MAX} are allowed"
            )
    for name, limit in (
        ("infill_template", max_prompt_bytes),
        ("tools", request_bytes_limit(max_prompt_bytes)),
    ):
        arr = get(name)
        size = 0 if arr is None else sum(len(v) if isinstance(v, bytes | str) else 0 for v in arr.reshape(-1))
        if size > limit:
            raise BadRequest(f"input '{name}' is {size} bytes, over this server's limit of {limit} bytes")


def output_array(name: str, values: list[Any]) -> np.ndarray:
    """An output tensor's array with the schema's dtype (text is UTF-8 encoded)."""
    spec = OUTPUT[name]
    if spec.datatype == "BYTES":
        return np.array([v.encode() for v in values], dtype=np.object_)
    return np.array(values, dtype=spec.numpy_dtype)


# ---- the clients' side ----------------------------------------------------------------------------------
def request_body(
    prompt: str | None, max_tokens: int, stream: bool, seed: int, options: Mapping[str, Any]
) -> dict:
    """The JSON body of `generate`/`generate_stream` (Triton converts each field to the input's datatype);
    options set to None are left out, so the server applies its default. `prompt` None: the options carry
    `messages` instead."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "seed": seed, "stream": stream}
    if prompt is not None:
        body = {"text_input": prompt, **body}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def input_array(name: str, value: Any) -> np.ndarray:
    """A gRPC input's array, typed by the schema: one value, or one per element of a list input."""
    spec = INPUT[name]
    if spec.datatype == "BYTES":
        items = [value] if isinstance(value, str | bytes) or not spec.is_list else list(value)
        return np.array([v if isinstance(v, bytes) else str(v).encode() for v in items], dtype=np.object_)
    return np.array([value], dtype=spec.numpy_dtype)


def raw_bytes(name: str, value: Any) -> bytes:
    """One value as Triton reads an input_data_file (model warm-up): little-endian, BYTES length-prefixed."""
    spec = INPUT[name]
    if spec.datatype == "BYTES":
        data = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<I", len(data)) + data
    return np.array([value], dtype=np.dtype(spec.numpy_dtype).newbyteorder("<")).tobytes()
