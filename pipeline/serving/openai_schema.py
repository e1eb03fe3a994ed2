"""The OpenAI request bodies dgpipe's frontend accepts, and how each maps onto the Triton model's inputs.

Every field OpenAI defines is either mapped, accepted only at its no-op value (`best_of=1`, `top_p=1`,
`store=false`, ...), accepted as the caller's own bookkeeping (`user`, `metadata`, `prompt_cache_key`,
`safety_identifier`: not used), or refused with a 400 naming it. A null is the field's default, as
OpenAI's spec allows (`"n": null` is n = 1). Unknown fields are refused, except the diffusion knobs, which
ride as extra body fields (the `openai` client's `extra_body`) under the Triton input names of
pipeline/serving/schema.py.

Temperature: a diffusion request samples every step at a temperature that falls linearly from `t_max` to
`t_min`. OpenAI's `temperature` T sets `t_max = T` and `t_min = T / 2` (the published defaults 0.8 -> 0.4
are T = 0.8), each clamped to the sampler's valid range (so T = 0 is the near-greedy 0.001). An explicit
`t_min` / `t_max` extra field wins over the mapping.

Structured output (docs/constrained.md): `response_format` {type: json_schema | json_object | text}, or
vLLM's extra body field `structured_outputs` {json | regex | choice | grammar | json_object}, or its
earlier `guided_json` (a schema), `guided_regex`, `guided_choice` and `guided_grammar`, one at most,
become the Triton inputs `guided_decoding_guide_type` / `guided_decoding_guide`. The guide is checked here
already (`GuideSpec.check`: a JSON schema by llguidance, a regex or choice by its own compiler), so a
construct dgpipe cannot honour is a 400 naming it before the request reaches Triton (the Triton model
compiles the token-level guide and answers a 400 as well).

Seed: OpenAI's `seed` is any 64-bit integer; the sampler's seeds are 63-bit, so a seed maps onto them as
`seed % 2**63` (deterministic: -1 is 2**63 - 1). An unset seed draws a fresh one (`secrets.randbits(63)`)
per request, so two unseeded requests differ at any temperature; the seed a response used is in its
`x-dgpipe-seed` header (send it back as `seed` to repeat the answer).

Load-tool fields (vLLM's, sent by guidellm and AIPerf): `ignore_eos` (the end token does not stop
generation: it runs to `max_tokens`), `min_tokens` (the end token does not stop it before that many
tokens) and `stream_options.continuous_usage_stats` (usage on every streamed chunk).

Choices, log-probabilities and tools: `n` choices are n requests with seeds `choice_seed(seed, i)`
(choice 0 the request's seed, the others drawn from it);
`logprobs` / `top_logprobs` become the Triton inputs `return_log_probs` / `top_logprobs`; `tools` and
`tool_choice` are planned by pipeline/serving/openai_tools.py (README, "OpenAI-compatible API").

Drafts: `stream_drafts: true` (with `stream: true`) adds the canvas after every denoise step to the stream
as `event: dgpipe.draft` server-sent events (pipeline/serving/openai_api.py); without it the stream is
plain OpenAI chunks.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pipeline.errors import InputError
from pipeline.limits import CHOICES_MAX, STOP_WORD_BYTES_MAX, TOP_LOGPROBS_MAX
from pipeline.model.config import SAMPLER_RANGES
from pipeline.sampler.constraints import GuideSpec
from pipeline.serving.schema import INT32_MAX, SEED_MAX

# field -> the only value we accept (its OpenAI default, a no-op here), or a tuple of such values
NO_OP_ONLY: dict[str, Any] = {
    "best_of": 1,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "echo": False,
    "store": False,  # nothing is stored for OpenAI's distillation or evals
    "service_tier": ("auto", "default"),  # one tier
}
# fields we refuse whatever their value (null aside)
UNSUPPORTED = (
    "logit_bias",
    "functions",
    "function_call",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
)
# vLLM's `structured_outputs` keys (StructuredOutputsParams) -> the Triton guide type; `grammar` is read in
# llguidance's Lark dialect, as vLLM's guidance backend reads it
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "lark_grammar",
    "json_object": "json",
}
DIFFUSION_KNOBS = ("max_denoising_steps", "entropy_bound", "confidence_threshold", "t_min", "t_max")


class RequestError(ValueError):
    """A request the frontend refuses: OpenAI's invalid_request_error, with the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def temperature_range(temperature: float) -> tuple[float, float]:
    """OpenAI temperature -> (t_min, t_max) of the diffusion schedule, clamped to the sampler's range."""
    lo, hi = SAMPLER_RANGES["t_max"]
    t_max = min(max(temperature, lo), hi)
    lo, hi = SAMPLER_RANGES["t_min"]
    return min(max(temperature / 2, lo), hi), t_max


# unknown fields refused; JSON types taken as sent ("10" is not a number, "yes" not a boolean); NaN and
# infinities refused (Python's json reads the non-standard NaN / Infinity literals)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
STOP_MAX = 4  # stop sequences per request, OpenAI's documented limit


SEED_SPACE = SEED_MAX + 1  # the sampler's seeds: 0 .. 2**63 - 1
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # what a client may send as `seed` (int64 or uint64)


_GOLDEN, _MASK64 = 0x9E3779B97F4A7C15, 2**64 - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request sampling with `seed`: choice 0's is `seed` (n = 1 is a single
    request), choice i's the i-th output of SplitMix64 seeded with `seed`, in the 63-bit seed space. So
    requests with neighbouring seeds draw unrelated choices (with seed + i, `seed=s, n=k` and `seed=s+1,
    n=k` shared k - 1 of them), as vLLM's per-request generator does; choice i is the answer a single
    request with its seed gets (the seeds are listed in the response's `x-dgpipe-choice-seeds` header)."""
    if index == 0:
        return seed
    x = (seed + index * _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % SEED_SPACE


def _null_is_default(data: Any) -> Any:
    """A body's null fields dropped before validation: OpenAI's spec lets a client send null for any optional
    field, meaning its default (the official client's `NotGiven` aside, other clients send `"n": null`)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def sampler_seed(seed: int | None) -> int:
    """The sampler seed for a request's `seed`: any 64-bit integer mapped into the 63-bit seed space
    (deterministically: the same `seed` always samples the same), a fresh random one when unset."""
    return secrets.randbits(63) if seed is None else seed % SEED_SPACE


def structured_outputs_guides(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(param, guide type, guide) for each constraint vLLM's `structured_outputs` object sets (null and
    false are unset, as vLLM's defaults); a key that is not a constraint dgpipe compiles is refused naming it."""
    found = []
    for key, value in spec.items():
        if value is None or value is False:
            continue
        param = f"structured_outputs.{key}"
        if key not in STRUCTURED_OUTPUTS:
            keys = ", ".join(STRUCTURED_OUTPUTS)
            raise RequestError(f"'{param}' is not supported (structured_outputs takes one of: {keys})", param)
        choices = isinstance(value, list) and all(isinstance(v, str) for v in value)
        guide = {
            "json": json.dumps(value) if isinstance(value, dict) else value,
            "choice": json.dumps(value) if choices else None,
            "json_object": "" if value is True else None,
        }.get(key, value)
        if not isinstance(guide, str):
            want = {
                "json": "a schema (object or string)",
                "choice": "a list of strings",
                "json_object": "true",
            }
            raise RequestError(f"'{param}' must be {want.get(key, 'a string')}", param)
        found.append((param, STRUCTURED_OUTPUTS[key], guide))
    return found


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) on every chunk
    # OpenAI's random padding of streamed chunks against size side channels: accepted, none is sent
    include_obfuscation: bool = False

    _nulls = model_validator(mode="before")(_null_is_default)


class _Common(BaseModel):
    """Fields shared by chat and text completions, read strictly (STRICT)."""

    model_config = STRICT
    _seed: int | None = PrivateAttr(None)
    _nulls = model_validator(mode="before")(_null_is_default)

    model: str
    # INT32 inputs in Triton: a larger value would not fit the tensor (the server's own cap is far lower)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)  # mapped by sampler_seed
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the caller's own bookkeeping (an end-user id, tags, a cache-routing key, an abuse-tracking id):
    # accepted, not used
    user: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # the diffusion knobs (extra body fields); their ranges are checked by the Triton model
    max_denoising_steps: int | None = Field(None, ge=1, le=INT32_MAX)
    entropy_bound: float | None = None
    confidence_threshold: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    # structured output: response_format (OpenAI) or one of vLLM's guided_* extra fields
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    stream_drafts: bool = False  # dgpipe.draft events in the stream (only with stream: true)
    # vLLM's fields that load tools send (guidellm, AIPerf): end tokens ignored until max_tokens / min_tokens
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    n: int = Field(1, ge=1, le=CHOICES_MAX)  # choices: rows of one batch, seeds choice_seed(seed, i)
    # OpenAI fields accepted only at their no-op value, or refused: checked in _refuse
    best_of: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    echo: bool | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    logit_bias: Any = None
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        """Refuse what we cannot honour (RequestError naming the field); pydantic has checked the types."""
        for name, ok in NO_OP_ONLY.items():
            value, allowed = getattr(self, name), ok if isinstance(ok, tuple) else (ok,)
            if value is not None and value not in allowed:
                only = " or ".join(map(repr, allowed))
                raise RequestError(f"'{name}' = {value!r} is not supported (only {only})", name)
        for name in UNSUPPORTED:
            if getattr(self, name) is not None:
                raise RequestError(f"'{name}' is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if "" in self.stop_words():
            raise RequestError(
                "'stop' holds an empty string, which would match at once: leave it out", "stop"
            )
        if len(self.stop_words()) > STOP_MAX:
            raise RequestError(
                f"'stop' holds {len(self.stop_words())} sequences; at most {STOP_MAX} are allowed", "stop"
            )
        if any(len(w.encode()) > STOP_WORD_BYTES_MAX for w in self.stop_words()):
            raise RequestError(f"'stop' holds a sequence over {STOP_WORD_BYTES_MAX} bytes (UTF-8)", "stop")
        if self.stream_drafts and not self.stream:
            raise RequestError(
                "'stream_drafts' needs 'stream': true (drafts are server-sent events)", "stream_drafts"
            )

    def guide(self) -> tuple[str, str] | None:
        """(guided_decoding_guide_type, guided_decoding_guide) from whichever structured-output field is set,
        checked as the Triton model will compile it (RequestError naming the field and the construct)."""
        found: list[tuple[str, str, str]] = []  # (param, type, guide)
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(("response_format", "json", ""))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise RequestError(
                        "'response_format' of type json_schema needs json_schema.schema (an object)",
                        "response_format",
                    )
                found.append(("response_format", "json_schema", json.dumps(spec["schema"])))
            elif kind != "text":
                raise RequestError(
                    f"'response_format' type {kind!r} is not supported (json_schema, json_object or text)",
                    "response_format",
                )
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            found.append(("guided_json", "json_schema", schema))
        if self.guided_regex is not None:
            found.append(("guided_regex", "regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(("guided_choice", "choice", json.dumps(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", "lark_grammar", self.guided_grammar))
        if self.structured_outputs is not None:
            found.extend(structured_outputs_guides(self.structured_outputs))
        if not found:
            return None
        if len(found) > 1:
            names = " and ".join(f"'{p}'" for p, _, _ in found)
            raise RequestError(f"{names} exclude each other: send one constraint", found[1][0])
        param, kind, guide = found[0]
        try:
            GuideSpec(kind, guide).check()
        except InputError as e:
            raise RequestError(str(e), param) from e
        return kind, guide

    def stop_words(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def inputs(self, max_tokens: int | None) -> dict[str, Any]:
        """The Triton inputs (schema names) this request sets, besides the prompt; None = the model's default.
        The seed is always set: the request's (mapped), or one drawn for it."""
        knobs: dict[str, Any] = {k: getattr(self, k) for k in DIFFUSION_KNOBS}
        if self.temperature is not None:
            t_min, t_max = temperature_range(self.temperature)
            knobs["t_min"] = t_min if knobs["t_min"] is None else knobs["t_min"]
            knobs["t_max"] = t_max if knobs["t_max"] is None else knobs["t_max"]
        out: dict[str, Any] = {
            "max_tokens": max_tokens,
            "seed": self.sampler_seed,
            "stream": self.stream,
            "ignore_eos": self.ignore_eos or None,
            "min_tokens": self.min_tokens or None,
            "stream_drafts": self.stream_drafts or None,
            "stop_words": self.stop_words() or None,
            "return_log_probs": True if self.top_logprobs_wanted() is not None else None,
            "top_logprobs": self.top_logprobs_wanted() or None,
            "exclude_input_in_output": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            **knobs,
        }
        if (guide := self.guide()) is not None:
            out["guided_decoding_guide_type"], out["guided_decoding_guide"] = guide
        return {k: v for k, v in out.items() if v is not None}

    def top_logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; k: each token's, with its k most probable alternatives (each request
        type reads its own fields: chat's logprobs + top_logprobs, the legacy API's logprobs count)."""
        return None

    def choice_seeds(self) -> list[int]:
        """The sampler seed of each of the n choices (choice_seed)."""
        return [choice_seed(self.sampler_seed, i) for i in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def sampler_seed(self) -> int:
        """The seed this request samples with, fixed on first use (drawn once when the request has none)."""
        if self._seed is None:
            self._seed = sampler_seed(self.seed)
        return self._seed


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        both = None not in (self.max_tokens, self.max_completion_tokens)
        if both and self.max_tokens != self.max_completion_tokens:
            raise RequestError(
                "'max_tokens' and 'max_completion_tokens' disagree: send one", "max_completion_tokens"
            )

    def triton_inputs(self) -> dict[str, Any]:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return {"messages": json.dumps(self.messages), **self.inputs(limit)}


class CompletionRequest(_Common):
    prompt: str | list[str]
    # the legacy API's logprobs: the number of most probable alternatives per token (0: the token's alone)
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def triton_inputs(self) -> dict[str, Any]:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestError("'prompt' as a list must hold exactly one string (batches: n/a)", "prompt")
            prompt = prompt[0]
        return {"text_input": prompt, **self.inputs(self.max_tokens)}
