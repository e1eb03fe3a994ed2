"""A request's progress through the runtime, called back by it on the worker thread: each committed canvas
(counted, its text cut at a stop word and streamed: `runtime.output_text`), each draft, and the finish (answered with the result, a timeout,
or released when the client went away). A failure that belongs to one request (its callbacks) is answered
to that request alone and the pass goes on for the others."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.serving.core import responses
from pipeline.serving.core.deadlines import expired_message
from pipeline.serving.core.jobs import Job
from pipeline.serving.core.logprobs import TokenTexts, token_entries
from pipeline.serving.core.responses import Failure
from pipeline.serving.error_kinds import ErrorKind

if TYPE_CHECKING:
    from pipeline.serving.core.state import CoreState


class Progress:
    def __init__(self, core: CoreState) -> None:
        self.core = core
        self.tokens = TokenTexts(core.session)

    def guarded(self, job: Job, callback: Callable[..., None], *args: Any) -> None:
        """Run a request's callback; if it fails, that request is answered with the error and cancelled."""
        if job.failed:
            return
        try:
            callback(job, *args)
        except Exception as e:
            self.core.runtime.cancel(job.request_id)
            self.core.fail(job, responses.internal_failure("in this request", e))

    def on_draft(self, job: Job, tokens: list[int], step: int) -> None:
        job.channel.send(responses.draft(self.core.session.decode(tokens), step))

    def on_canvas(self, job: Job, tokens: list[int]) -> None:
        core, m = self.core, self.core.metrics
        job.canvases += 1
        m.canvases.increment(1)
        m.tokens.increment(len(tokens))
        now = time.perf_counter()
        m.canvas_latency.observe(now - (job.started if job.last_canvas is None else job.last_canvas))
        job.last_canvas = now
        if job.first_canvas is None:
            job.first_canvas = now - job.started
            m.time_to_first_canvas.observe(job.first_canvas)
        before, emitted = len(job.output.ids), len(tokens)
        new = job.output.add(tokens)
        if job.output.stopped:
            core.runtime.cancel(job.request_id)
            tokens = tokens[: max(0, len(job.output.ids) - before)]
        job.tokens += len(tokens)  # the tokens of the text returned (a stop word cut drops the rest)
        if job.flags[
            "return_log_probs"
        ]:  # the returned tokens' entries (the runtime's are per emitted token)
            records = job.result.logprobs[job.logprobs_read : job.logprobs_read + emitted]
            job.logprobs_read += emitted
            job.logprobs += token_entries(self.tokens, tokens, records[: len(tokens)])
        if job.flags["stream"] and new:
            job.channel.send(responses.piece(new, **self.counts(job), logprobs=self.take_logprobs(job)))

    @staticmethod
    def take_logprobs(job: Job) -> list[dict[str, Any]] | None:
        """The token entries not sent yet (None: the request did not ask for them)."""
        if not job.flags["return_log_probs"]:
            return None
        entries, job.logprobs = job.logprobs, []
        return entries

    @staticmethod
    def counts(job: Job) -> dict[str, int | None]:
        """Prompt tokens (and of them, those the prefix cache held) and tokens so far, each only when the
        request asked for it (None)."""
        flags, result = job.flags, job.result
        prompt = flags["return_num_input_tokens"]
        return {
            "input_tokens": len(job.prompt_ids) if prompt else None,
            "cached_tokens": (result.cached_tokens if result is not None else 0) if prompt else None,
            "output_tokens": job.tokens if flags["return_num_output_tokens"] else None,
        }

    def on_finish(self, job: Job, res: Any) -> None:
        core, m = self.core, self.core.metrics
        # metrics first: a client that reads them after its final response sees its request counted
        core.jobs.pop(job.request_id, None)
        core.update_load()
        reason = "stop" if job.output.stopped else res.finish_reason
        if reason == "cancelled" and job.channel.is_cancelled():
            m.cancelled.increment(1)
            # the client went away: no response, but the final release still frees the request in the
            # transport (Triton keeps a cancelled request, and the model loaded, until then)
            job.channel.send(None)
            return
        if reason == "cancelled" and job.expired:
            m.expired.increment(1)
            message = expired_message(job.timeout_s, job.canvases, core.limits.max_request_seconds)
            core.fail(job, Failure(ErrorKind.TIMEOUT, message))
            return
        if reason == "error":  # this request's guide could not go on; the batch went on without it
            core.fail(job, Failure(ErrorKind.INVALID_REQUEST, res.error or "the request failed"))
            return
        rest = job.output.finish()  # the text held back for the next canvas: there is none
        if job.flags["stream"] and rest:
            job.channel.send(responses.piece(rest, **self.counts(job), logprobs=self.take_logprobs(job)))
        for steps in res.steps_per_canvas:
            m.steps.increment(steps)
            m.steps_per_canvas.observe(steps)
        m.request_latency.observe(time.perf_counter() - job.started)
        job.channel.send(self.final(job, reason, list(res.steps_per_canvas)))

    def final(self, job: Job, reason: str, steps: list[int]) -> responses.Outputs:
        """The final response: the whole text unless streamed (then the pieces went out already)."""
        if job.flags["stream"]:
            text = ""
        elif job.flags["exclude_input_in_output"]:
            text = job.output.text
        else:  # the prompt as the model read it (a chat: its rendered template), for text and messages alike
            text = self.core.session.decode_prompt(job.prompt_ids) + job.output.text
        return responses.final(text, reason, steps, **self.counts(job), logprobs=self.take_logprobs(job))
