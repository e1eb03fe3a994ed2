"""Batch generation in-process: inputs (a prompt or a JSONL file of prompts/chats) through one loaded session
and one runtime, as `dgpipe generate` runs them.

Every input is read and checked before the model loads (a bad line in a 1,000-line file fails at once,
naming FILE:LINE); the requests are then submitted together and share denoise passes, or run one at a time
when the caller streams (so streamed canvases stay in input order). Nothing here prints: text pieces and
drafts go to the caller's callbacks, results come back as data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.errors import DgpipeError
from pipeline.limits import DEFAULT_MAX_TOKENS
from pipeline.runtime.output_text import OutputText

Guide = tuple[str, str]  # (guide type, guide): "json_schema" / "regex" / "choice" and its text


class GenerateInput(NamedTuple):
    """One input: the text (a chat's last user message: what a task format reads and `present` shows),
    the chat messages (None for a plain prompt), and "FILE:LINE" for a --file line (errors name it)."""

    prompt: str
    messages: list | None = None
    where: str | None = None


@dataclass(frozen=True)
class GenerateSettings:
    """What every input of one batch shares: model, sampler overrides, canvas, constraint, execution."""

    model: Path | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampler: dict[str, Any] = field(default_factory=dict)  # SamplerConfig overrides; None = the model's
    seed: int = 0
    canvas_length: int | None = None
    infill: str | None = None  # canvas template: '_' marks a free position, other text is pinned
    default_infill: bool = True  # pin what the prompt format pins (a Sudoku's givens) without --infill
    guide: Guide | None = None
    stream: bool = False  # each committed canvas as it completes (one request at a time: in input order)
    drafts: bool = False  # each refinement step of the canvas (one request at a time)
    dtype: str = "auto"
    device: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise DgpipeError(f"--max-tokens must be >= 1 (got {self.max_tokens})")


@dataclass
class GenerateOutput:
    """One input's answer, with the figures `--json` reports and what the prompt format shows of it."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str
    steps_per_canvas: list[int]
    time_to_first_canvas_s: float
    total_s: float
    sampler: dict[str, Any]
    seed: int
    shown: str  # the answer as the prompt format presents it (a Sudoku grid)
    verdict: str | None  # the format's judgement of it (solved / invalid), None when it has none

    def as_dict(self) -> dict[str, Any]:
        secs = self.total_s
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "steps_per_canvas": self.steps_per_canvas,
            "time_to_first_canvas_s": round(self.time_to_first_canvas_s, 4),
            "total_s": round(secs, 4),
            "tokens_per_s": round(len(self.tokens) / secs, 2) if secs > 0 else None,
            "sampler": self.sampler,
            "seed": self.seed,
        }


def parse_guide(json_schema: Path | None, regex: str | None, choice: str | None) -> Guide | None:
    """--json-schema / --regex / --choice as (guide type, guide); the guide is checked (compiled to a regex)
    before any model loads, so an unsupported construct is one error line naming it."""
    from pipeline.sampler.constraints import GuideSpec

    given = [
        name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice)) if v
    ]
    if len(given) > 1:
        raise DgpipeError(f"{' and '.join(given)} exclude each other: give one constraint")
    if json_schema is not None:
        if not json_schema.is_file():
            raise DgpipeError(f"--json-schema {json_schema}: no such file")
        guide = ("json_schema", json_schema.read_text())
    elif regex is not None:
        guide = ("regex", regex)
    elif choice is not None:
        guide = ("choice", json.dumps([c for c in choice.split(",") if c]))
    else:
        return None
    GuideSpec(*guide).check()
    return guide


def read_inputs(prompt: str | None, chat: bool, system: str | None, file: Path | None) -> list[GenerateInput]:
    """One input per prompt text, or per non-blank line of the JSONL `file` (a {"prompt": ...} or a
    {"messages": [...]} per line); every line is checked here, before any work."""
    from pipeline.runtime.chat_template import chat_messages

    if (prompt is None) == (file is None):
        raise DgpipeError("give a prompt or --file PROMPTS.jsonl (one of them)")
    if file is None:
        assert prompt is not None
        return [GenerateInput(prompt, chat_messages(prompt, system) if chat else None)]
    if not file.is_file():
        raise DgpipeError(f"--file {file}: no such file")
    items = [
        _input_line(line, f"{file}:{n}", chat, system)
        for n, line in enumerate(file.read_text().splitlines(), 1)
        if line.strip()
    ]
    if not items:
        raise DgpipeError(f"--file {file}: no prompts in it")
    return items


def _input_line(line: str, where: str, chat: bool, system: str | None) -> GenerateInput:
    from pipeline.runtime.chat_template import chat_messages, last_user_text, parse_messages

    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DgpipeError(f"{where}: not valid JSON ({e.msg})") from e
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        text = row["prompt"]
        return GenerateInput(text, chat_messages(text, system) if chat else None, where)
    if isinstance(row, dict) and "messages" in row:
        with naming(where):
            messages = parse_messages(row["messages"])
            return GenerateInput(last_user_text(messages), messages, where)
    raise DgpipeError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}')


@contextmanager
def naming(where: str | None) -> Iterator[None]:
    """A user error raised inside the block, prefixed with the input it is about ("FILE:LINE: ...")."""
    try:
        yield
    except DgpipeError as e:
        if where is None:
            raise
        raise type(e)(f"{where}: {e}") from e


@dataclass
class Callbacks:
    """Where streamed output goes while the batch runs (each None: not wanted)."""

    on_piece: Callable[[str], None] | None = None  # the text a committed canvas adds (`OutputText`)
    on_draft: Callable[[int, str], None] | None = None  # (step, canvas text) of each refinement step
    on_done: Callable[[], None] | None = None  # one input's stream ended


def generate_batch(
    inputs: list[GenerateInput], settings: GenerateSettings, callbacks: Callbacks | None = None
) -> list[GenerateOutput]:
    """Every input through one loaded session and one runtime; results in input order."""
    import torch

    from pipeline.runtime.session import load_session

    s, cb = settings, callbacks or Callbacks()
    session = load_session(s.model, s.dtype, s.device, s.canvas_length, compile=s.compile)
    sampler = session.sampler(**s.sampler)
    guide = None if s.guide is None else session.compile_guide(*s.guide)  # once, shared by every input
    requests = [_request(session, item, s, sampler, guide, cb) for item in inputs]
    runtime = _runtime(session, requests, s)
    for item, req in zip(inputs, requests, strict=True):
        with naming(item.where):
            runtime.validate(req)  # every input checked before any generation
    with torch.inference_mode():
        results = runtime.generate(requests)
    if failed := next((r for r in results if r.error), None):  # a guide this vocabulary cannot finish
        raise DgpipeError(failed.error, "change the guide so that this model's tokens can spell it")
    outputs = []
    for item, res in zip(inputs, results, strict=True):
        text = session.decode(res.tokens)
        shown, verdict = session.prompt_format.present(item.prompt, text)
        outputs.append(
            GenerateOutput(
                text=text,
                tokens=res.tokens,
                prompt_tokens=len(res.request.prompt_ids),
                finish_reason=res.finish_reason,
                steps_per_canvas=res.steps_per_canvas,
                time_to_first_canvas_s=res.time_to_first_canvas,
                total_s=res.finished - res.started,
                sampler=sampler.model_dump(),
                seed=s.seed,
                shown=shown,
                verdict=verdict,
            )
        )
    return outputs


def _request(session, item: GenerateInput, s: GenerateSettings, sampler, guide, cb: Callbacks):
    """The runtime request for one input: its prompt ids, canvas template, guide and callbacks."""
    from pipeline.runtime.scheduler import Request

    with naming(item.where):
        prompt_ids = (
            session.encode_prompt(item.prompt)
            if item.messages is None
            else session.encode_messages(item.messages)
        )
        if s.infill is not None:
            template = session.build_template(s.infill)
        else:
            template = session.default_template(item.prompt) if s.default_infill else None
    on_piece, on_draft, on_done = cb.on_piece, cb.on_draft, cb.on_done
    text = OutputText(session.decode)  # a character split between canvases comes out whole

    def canvas(req, tokens: list[int]) -> None:
        if new := text.add(tokens):
            on_piece(new)

    def finish(res) -> None:
        if on_piece and (rest := text.finish()):
            on_piece(rest)
        if on_done:
            on_done()

    return Request(
        prompt_ids=prompt_ids,
        max_tokens=s.max_tokens,
        sampler=sampler,
        seed=s.seed,
        template=template,
        guide=guide,
        on_canvas=canvas if on_piece else None,
        on_draft=(lambda req, tokens, step: on_draft(step, session.decode(tokens))) if on_draft else None,
        on_finish=finish if on_piece or on_done else None,
    )


def _runtime(session, requests: list, s: GenerateSettings):
    """One runtime sized for the batch: every request's context fits, up to the engine's batch."""
    from pipeline.limits import DEFAULTS
    from pipeline.runtime.scheduler import BlockDiffusionRuntime

    return BlockDiffusionRuntime(
        session.model,
        max_batch=1 if s.stream or s.drafts else min(len(requests), DEFAULTS.max_batch),
        max_len=max(row_context(session, len(r.prompt_ids), s.max_tokens) for r in requests),
    )


def row_context(session, prompt_len: int, max_tokens: int) -> int:
    """Cached positions one request needs: its prompt, its canvases and one more, within the model's
    position limit."""
    length = session.model.config.canvas_length
    canvases = -(-max_tokens // length)
    need = prompt_len + (canvases + 1) * length
    return min(max(need, prompt_len + length), session.model.cfg.max_position_embeddings)
