"""Request intake: a request's inputs, checked against the schema and the server's limits, become a Job
and the runtime's Request (prompt encoded, sampler and guide built, validated by the runtime). Anything
wrong is a BadRequest with the message the client sees: a bad request never reaches the batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.errors import DgpipeError
from pipeline.limits import context_length
from pipeline.runtime.output_text import OutputText
from pipeline.serving import schema
from pipeline.serving.core.jobs import Job
from pipeline.serving.core.responses import Channel
from pipeline.serving.schema import BadRequest

if TYPE_CHECKING:
    from pipeline.serving.core.state import CoreState

InputGetter = Callable[[str], np.ndarray | None]  # an input's array by its schema name; None when absent


class Intake:
    def __init__(self, core: CoreState) -> None:
        self.core = core

    def build(self, get: InputGetter, parameters: Mapping[str, Any], channel: Channel) -> tuple[Job, Any]:
        """The Job and the runtime Request for one request; BadRequest when anything about it is wrong."""
        session = self.core.session
        parsed = schema.parse_request(get, parameters, self.core.limits, session.max_new_tokens)
        try:
            return self._build(parsed, channel)
        except DgpipeError as e:  # the session's or the runtime's own checks
            raise BadRequest(str(e)) from e

    def _prompt_ids(self, parsed: schema.ParsedRequest) -> list[int]:
        session, limit = self.core.session, self.core.limits.max_prompt
        ids = (
            session.encode_prompt(parsed.prompt)
            if parsed.messages is None
            else session.encode_messages(parsed.messages, parsed.tools)  # through the chat template
        )
        if len(ids) > limit:
            raise BadRequest(f"prompt has {len(ids)} tokens, over this server's limit of {limit}")
        return ids

    def _fit_context(self, parsed: schema.ParsedRequest, prompt_tokens: int) -> None:
        """The prompt and max_tokens within the runtime's context (`context_length`): a max_tokens the
        request asked for that does not fit is refused with the numbers, the default one shortened to fit
        (when nothing fits, the runtime still commits its first canvas, then ends on "length")."""
        runtime = self.core.runtime
        context, canvas = runtime.max_len, runtime.canvas_length
        need = context_length(prompt_tokens, parsed.max_tokens, canvas)
        if need <= context:
            return
        room = context - context_length(prompt_tokens, 0, canvas)
        if parsed.max_tokens_asked:
            fix = f"ask for max_tokens <= {room}" if room >= 1 else "send a shorter prompt"
            raise BadRequest(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {parsed.max_tokens}: together they "
                f"need a {need}-token context (prompt + max_tokens + two {canvas}-token canvases), over this "
                f"model's context of {context} tokens; {fix}"
            )
        if room >= 1:
            parsed.max_tokens = room
            parsed.min_tokens = min(parsed.min_tokens, room)

    def _build(self, parsed: schema.ParsedRequest, channel: Channel) -> tuple[Job, Any]:
        from pipeline.runtime.scheduler import Request

        core, session = self.core, self.core.session
        if parsed.tool_choice == "auto" and session.tool_call_format is None:
            raise BadRequest(
                "tool_choice 'auto' needs a chat template that declares a tool-call format (Hermes-style "
                "<tool_call> blocks), and this checkpoint's declares none, so the model has no way of its own "
                "to call a tool: send tool_choice 'required' or name a function (the arguments are then "
                "generated under the function's JSON schema)"
            )
        sampler = session.sampler(**parsed.sampler)
        prompt_ids = self._prompt_ids(parsed)
        self._fit_context(parsed, len(prompt_ids))
        template = (
            session.build_template(parsed.infill_template)
            if parsed.infill_template is not None
            else session.default_template(parsed.prompt)
        )
        guide = None if parsed.guide is None else core.guides.compiled(*parsed.guide)
        output = OutputText(session.decode, parsed.stop_words)
        job = Job(channel, next(core.ids), prompt_ids, parsed.flags, output, timeout_s=parsed.timeout_s)
        events = core.progress
        req = Request(
            prompt_ids=prompt_ids,
            max_tokens=parsed.max_tokens,
            min_tokens=parsed.min_tokens,
            logprobs=parsed.logprobs,
            sampler=sampler,
            seed=parsed.seed,
            request_id=job.request_id,
            draw_id=0,  # the seed alone decides the draws: same seed, same answer, whatever the id
            template=template,
            guide=guide,
            on_canvas=lambda r, toks: events.guarded(job, events.on_canvas, toks),
            on_draft=(lambda r, toks, step: events.guarded(job, events.on_draft, toks, step))
            if parsed.flags["stream_drafts"]
            else None,
            on_finish=lambda res: events.guarded(job, events.on_finish, res),
        )
        core.runtime.validate(req)
        return job, req
