"""Request intake: a request's inputs, checked against the schema and the server's limits, become a Job
and the runtime's Request (prompt encoded, sampler and guide built, validated by the runtime). Anything
wrong is a BadRequest with the message the client sees: a bad request never reaches the batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.errors import DgpipeError
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
        parsed = schema.parse_request(get, parameters, self.core.limits)
        try:
            return self._build(parsed, channel)
        except DgpipeError as e:  # the session's or the runtime's own checks
            raise BadRequest(str(e)) from e

    def _prompt_ids(self, parsed: schema.ParsedRequest) -> list[int]:
        session, limit = self.core.session, self.core.limits.max_prompt
        ids = (
            session.encode_prompt(parsed.prompt)
            if parsed.messages is None
            else session.encode_messages(parsed.messages)  # through the checkpoint's chat template
        )
        if len(ids) > limit:
            raise BadRequest(f"prompt has {len(ids)} tokens, over this server's limit of {limit}")
        return ids

    def _build(self, parsed: schema.ParsedRequest, channel: Channel) -> tuple[Job, Any]:
        from pipeline.runtime.scheduler import Request

        core, session = self.core, self.core.session
        sampler = session.sampler(**parsed.sampler)
        prompt_ids = self._prompt_ids(parsed)
        template = (
            session.build_template(parsed.infill_template)
            if parsed.infill_template is not None
            else session.default_template(parsed.prompt)
        )
        guide = None if parsed.guide is None else session.compile_guide(*parsed.guide)
        job = Job(
            channel, next(core.ids), prompt_ids, parsed.flags, parsed.stop_words, timeout_s=parsed.timeout_s
        )
        events = core.progress
        req = Request(
            prompt_ids=prompt_ids,
            max_tokens=parsed.max_tokens,
            min_tokens=parsed.min_tokens,
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
