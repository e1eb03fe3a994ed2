"""Every cap dgpipe enforces, in one typed object, and the rules derived from them.

`Limits` holds the engine caps (what a TensorRT plan's profiles accept: `max_batch`, `max_prompt`,
`max_context`) and the serving caps (what one request may ask for: `max_tokens`, `max_steps`,
`max_request_seconds`). Each field name is the limit's one name: the CLI option (`--max-batch`), the
config.pbtxt parameter the Triton model reads, the key in `engine.json` and the build manifest, and the
attribute in code. Its defaults are the only defaults: every command, stage and model reads them here.

The engine stage records the engine caps as data (`engine.json` `limits`, the build manifest's engine
record); package, render and serve read them back with `Limits.from_record`, never from a command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import DgpipeError, validation_error

INT32_MAX = 2**31 - 1  # the Triton tensors that carry a limit are INT32


class Limits(BaseModel):
    """Engine caps and serving caps. Frozen: a stage passes it on, it never changes under a later stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch: int = Field(8, ge=1, le=INT32_MAX)  # rows of one pass (requests sharing a denoise pass)
    max_prompt: int = Field(2048, ge=1, le=INT32_MAX)  # longest prompt (tokens) of one prefill pass
    # cached tokens a row may attend to (prompt + committed canvases): the plan's past_full profile
    max_context: int = Field(8192, ge=1, le=INT32_MAX)
    max_tokens: int = Field(4096, ge=1, le=INT32_MAX)  # largest max_tokens a request may ask for
    max_steps: int = Field(256, ge=1, le=INT32_MAX)  # largest max_denoising_steps (passes per canvas)
    # seconds a request may run once it has a batch slot before the server ends it and frees the slot; a
    # request may ask for less (its timeout_s input). Bounds what an abandoned HTTP request can cost:
    # Triton's HTTP endpoint does not pass a client's disconnect on to the model (gRPC does)
    max_request_seconds: int = Field(600, ge=1, le=INT32_MAX)
    # accepted requests waiting for a batch slot: one more is refused at once (503 with Retry-After, gRPC
    # UNAVAILABLE) instead of waiting behind the backlog until its client gives up, so that a load balancer
    # or client retries it on another replica; 0: unbounded. 256 is 32 full batches at the default max_batch
    max_queue: int = Field(256, ge=0, le=INT32_MAX)
    # UTF-8 bytes of one prompt (text_input, or the text of the chat messages), checked before the prompt is
    # tokenized or rendered, so an oversized prompt costs a length check, not seconds of the model's request
    # thread (health pings wait on that thread). Its own cap, not derived from max_prompt: no tokenizer
    # bounds the bytes of one token, so a bytes-per-token rule would refuse prompts the token cap admits.
    # 1 MiB is 512 bytes per token at the default max_prompt, and tokenizes in well under a second
    max_prompt_bytes: int = Field(1048576, ge=1, le=INT32_MAX)
    # a constrained-decoding guide (JSON schema, regex, choice, Lark grammar): its UTF-8 bytes, checked before
    # it compiles, and what compiling it may take in the compile child (pipeline/serving/core/guide_worker):
    # wall seconds and MiB of address space beyond the child's own. Real-world schemas compile in
    # milliseconds (JSONSchemaBench p95 well under a second); a 2^17-state regex takes seconds and gigabytes
    max_guide_bytes: int = Field(262144, ge=1, le=INT32_MAX)
    # a regex's positions once counted repeats are unrolled (`[1-9]{50000}`: 50,000), counted before it
    # compiles: its token automaton grows with them
    max_regex_positions: int = Field(10000, ge=1, le=INT32_MAX)
    max_guide_seconds: int = Field(10, ge=1, le=INT32_MAX)
    max_guide_memory_mib: int = Field(2048, ge=64, le=INT32_MAX)
    # memory for the K/V of prompt blocks kept across requests (prefix caching: a shared system prompt or
    # a chat's earlier turns are prefilled once); 0 turns it off. 1 GiB holds ~4,700 tokens of the 26B in
    # bf16 (~225 KB per token over its 30 layers), ~65,000 of the medium bench model in fp32
    prefix_cache_mib: int = Field(1024, ge=0, le=INT32_MAX)

    ENGINE_FIELDS: ClassVar[tuple[str, ...]] = ("max_batch", "max_prompt", "max_context")
    SERVING_FIELDS: ClassVar[tuple[str, ...]] = (
        "max_tokens",
        "max_steps",
        "max_request_seconds",
        "max_queue",
        "max_prompt_bytes",
        "max_guide_bytes",
        "max_regex_positions",
        "max_guide_seconds",
        "max_guide_memory_mib",
        "prefix_cache_mib",
    )

    @classmethod
    def of(cls, where: str = "limits", **values: int | None) -> Limits:
        """Limits from the given values (None: the default), with a clear error naming the bad option."""
        given = {k: v for k, v in values.items() if v is not None}
        with validation_error(lambda field, msg: f"{where}: {flag(field)} {msg}"):
            return cls(**given)

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None, where: str) -> Limits:
        """The limits a stage recorded as data (`engine.json`, the build manifest); defaults for the rest."""
        if record is not None and not isinstance(record, Mapping):
            raise DgpipeError(f"{where}: limits must be a mapping of limit name -> value")
        return cls.of(where, **dict(record or {}))

    def merged(self, **overrides: int | None) -> Limits:
        """These limits with the values given (None: keep), checked: the CLI over the recorded ones."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return Limits.of("limits", **{**self.model_dump(), **given})

    def engine_values(self) -> dict[str, int]:
        """The caps an engine is built for, by name (the serving caps do not change a plan)."""
        return {k: getattr(self, k) for k in self.ENGINE_FIELDS}

    def engine_flags(self) -> list[str]:
        """The `dgpipe engine build` options that build a plan for these caps (the node's command)."""
        return [a for k, v in self.engine_values().items() for a in (flag(k), str(v))]

    def validate(self, canvas: int) -> None:
        """An engine for these caps holds a whole prompt and one canvas after it."""
        if self.max_context < self.max_prompt + canvas:
            raise DgpipeError(
                f"--max-context {self.max_context} leaves no room for a {canvas}-token canvas after a "
                f"{self.max_prompt}-token prompt",
                hint=f"use --max-context >= {self.max_prompt + canvas}",
            )

    def check_fits(self, canvas: int) -> None:
        """A request for `max_tokens` after the longest prompt fits the engine's context (`context_length`):
        checked before a build runs any stage, and when a build's repository is written."""
        need = context_length(self.max_prompt, self.max_tokens, canvas)
        if need > self.max_context:
            room = self.max_context - context_length(self.max_prompt, 0, canvas)
            raise DgpipeError(
                f"--max-tokens {self.max_tokens} after a {self.max_prompt}-token prompt needs a {need}-token "
                f"context; the engines hold --max-context {self.max_context}",
                f"use --max-tokens <= {room}, a shorter --max-prompt, or --max-context >= {need}",
            )


def flag(field_name: str) -> str:
    """max_batch -> --max-batch: the CLI option of a limit."""
    return "--" + field_name.replace("_", "-")


# JSON spells one UTF-8 byte in at most 6 (a control character as \u00XX): the most a prompt of
# `max_prompt_bytes` takes in a JSON body or the `messages` input
JSON_BYTES_PER_BYTE = 6
REQUEST_OVERHEAD_BYTES = 1 << 20  # room in a request body for what is not the prompt (options, guides, roles)


def request_bytes_limit(max_prompt_bytes: int) -> int:
    """The largest request body (OpenAI JSON) or `messages` input a server reads: a prompt at its byte cap
    in the worst JSON escaping, and the rest of the request. Bigger is refused before it is parsed."""
    return JSON_BYTES_PER_BYTE * max_prompt_bytes + REQUEST_OVERHEAD_BYTES


def context_length(prompt_tokens: int, max_tokens: int, canvas_length: int) -> int:
    """The KV-cache length a row needs to produce `max_tokens` after `prompt_tokens`: the prompt, the
    tokens, and two canvases (the runtime stops a row once the next canvas and the one being denoised no
    longer fit, `BlockDiffusionRuntime`). The one rule for the runtime, the Triton model and the benchmarks."""
    return prompt_tokens + max_tokens + 2 * canvas_length


DEFAULTS = Limits()  # the defaults, for signatures that take one limit as a plain value

# prompts are prefilled in chunks ending at multiples of this many tokens, and the prefix cache keeps
# blocks of it: one chunk is one 26B canvas, large enough that a GPU pass over it is not just a weight read
PREFILL_CHUNK_TOKENS = 256

# what a request that names no max_tokens generates at most (Limits.max_tokens caps what one may name)
DEFAULT_MAX_TOKENS = 256

# OpenAI's own caps on the request fields dgpipe honours as they are (platform.openai.com/docs/api-reference):
# `top_logprobs` (chat) takes 0..20 alternatives per token; `n` is dgpipe's own cap on choices per request
# (each choice is a batch row, so it also stays within one pass's rows)
TOP_LOGPROBS_MAX = 20
# dgpipe's own caps on a request's stop words (Triton's `stop_words`; the OpenAI port takes OpenAI's 4): after
# every canvas the output is searched for each and a tail that may begin one is held back, work on the
# runtime loop that grows with their number and length, so neither is left unbounded
STOP_WORDS_MAX = 16
STOP_WORD_BYTES_MAX = 1024
CHOICES_MAX = 8
# what a log-probability of -inf (a token the distribution gives 0: masked out, or underflowed) is reported
# as, since JSON has no infinity; vLLM's OpenAI server uses the same floor
LOGPROB_FLOOR = -9999.0
