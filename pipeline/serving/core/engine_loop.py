"""The runtime loop, on the core's worker thread: it owns the BlockDiffusionRuntime. Each turn it submits
new requests (they join the batch at canvas boundaries), answers health pings (proof the loop is alive),
cancels requests the client abandoned or that ran past their deadline (and all of them once a drain timed
out: core.drain), and runs one denoise pass shared by
every request in flight. A failed pass fails the requests in the batch, and the server keeps serving those
still queued: out of GPU memory as UNAVAILABLE (retry), anything else as INTERNAL. A failure that leaves the
GPU unusable (a sticky CUDA error: `pipeline.runtime.device_errors`) fails every request and marks the core
broken, so health pings fail and the watchdog or the kubelet restarts the server."""

from __future__ import annotations

import contextlib
import queue
import time
import traceback
from typing import TYPE_CHECKING

from pipeline.serving.core import responses
from pipeline.serving.core.responses import Failure
from pipeline.serving.error_kinds import ErrorKind

if TYPE_CHECKING:
    from pipeline.serving.core.state import CoreState

DRAIN_EXPIRED = (
    "this server stopped before the request finished (its drain timed out): retry on another replica"
)
POLL_S = 0.05  # how long an idle loop waits for a request before it looks at pings and deadlines again
CANCEL_POLL_S = 0.1  # how often the clients are asked whether they went away (a step is ~10-100 ms)


class EngineLoop:
    def __init__(self, core: CoreState) -> None:
        self.core = core
        self._cancels_polled = float("-inf")  # when the clients were last asked whether they went away

    def run(self) -> None:
        while self.core.running:
            try:
                self.turn()
            except Exception as e:  # outside a step (a bug): answer what the runtime holds, keep the loop
                self.core.fail_all(responses.internal_failure("in the runtime loop", e))

    def turn(self) -> None:
        """One turn of the loop: intake, pings, deadlines, then one step of the runtime when it has work."""
        import torch

        core = self.core
        self.submit_new()
        self.answer_pings()
        core.update_load()
        self.cancel_abandoned(time.perf_counter())
        if core.runtime.busy():
            try:
                with torch.inference_mode():
                    core.runtime.step()
            except Exception as e:  # fail the requests in the batch, keep the server serving
                self.step_failed(e)
            if (cache := getattr(core.runtime, "prefix_cache", None)) is not None:
                core.metrics.record_prefix_cache(cache)
            self.record_rows_allowed()
            core.update_load()  # requests admitted to batch slots leave the queue

    def record_rows_allowed(self) -> None:
        """Set the rows gauge to what the runtime admits (from the start: max_batch, before any step)."""
        if (rows := getattr(self.core.runtime, "rows_allowed", None)) is not None:
            self.core.metrics.record_rows_allowed(rows)

    def step_failed(self, error: Exception) -> None:
        """Answer the requests a failed step had in its batch; the queued ones stay queued. A step that
        failed with no request in its batch (none admitted) answers every request, so that none can fail
        the loop forever."""
        import torch

        from pipeline.runtime.device_errors import out_of_memory, unusable

        core = self.core
        device = getattr(core.runtime, "device", torch.device("cpu"))
        if (lost := unusable(device)) is not None:
            core.broken = f"the GPU can run no more work in this process ({lost}): restart the server"
            core.fail_all(Failure(ErrorKind.UNAVAILABLE, core.broken))
            return
        rows = core.runtime.drop_running()
        oom = out_of_memory(error)
        if oom:
            core.metrics.out_of_memory.increment(1)
            if rows:  # the batch that failed: the runtime admits fewer rows from now on
                core.runtime.after_out_of_memory(len(rows))
            allowed = core.runtime.rows_allowed
            core.log_error(f"dgpipe: out of GPU memory at a batch of {len(rows)}: {error}; admitting {allowed} "
                           f"rows at a time now")  # fmt: skip
            failure = Failure(ErrorKind.UNAVAILABLE, f"the GPU ran out of memory at a batch of {len(rows)} "
                              f"requests: retry (the server now admits {allowed} at a time, more as canvases finish); if it recurs, serve "
                              "with a smaller max_batch (--max-batch of dgpipe build or package) or max_tokens")  # fmt: skip
        else:
            failure = responses.internal_failure("during generation", error)
        if rows:
            core.fail_requests([r.request.request_id for r in rows], failure)
        else:
            core.fail_all(failure)
        if oom and device.type == "cuda":  # what the failed step held, for the next one
            release_frames(error)
            with contextlib.suppress(Exception):  # answered already: nothing here may stop the loop
                torch.cuda.empty_cache()

    def submit_new(self) -> None:
        """Hand the queued requests to the runtime (waiting a little for one when the batch is idle)."""
        core = self.core
        block = not core.runtime.busy()
        try:
            while True:
                job, req = core.inbox.get(timeout=POLL_S) if block else core.inbox.get_nowait()
                block = False
                try:
                    job.result = core.runtime.submit(req)
                except Exception as e:  # this request alone is refused; the batch never saw it
                    core.fail(job, responses.refusal("submitting the request", e))
                    continue
                core.jobs[job.request_id] = job
        except queue.Empty:
            pass

    def answer_pings(self) -> None:
        """Alive: this loop runs and reaches its queues, and its GPU can still run work."""
        core = self.core
        answer = responses.ALIVE if core.broken is None else Failure(ErrorKind.UNAVAILABLE, core.broken)
        while not core.pings.empty():
            core.pings.get_nowait().send(answer)

    def cancel_abandoned(self, now: float) -> None:
        """Cancel requests whose client went away or whose deadline passed; the runtime lets them go at
        its next step and their finish answers them (progress.on_finish). Whether a client went away is
        asked every `CANCEL_POLL_S`, not every step: in Triton's Python backend each `is_cancelled` is a
        round trip to the server process, one per request in flight or queued."""
        core = self.core
        poll = now - self._cancels_polled >= CANCEL_POLL_S
        if poll:
            self._cancels_polled = now
            if core.jobs and core.drain.aborting():  # the drain timed out: the server stops next
                core.fail_all(Failure(ErrorKind.UNAVAILABLE, DRAIN_EXPIRED))
                return
        for job in list(core.jobs.values()):
            if poll and job.channel.is_cancelled():
                core.runtime.cancel(job.request_id)
            elif not job.expired and job.overdue(now):
                job.expired = True
                core.runtime.cancel(job.request_id)


def release_frames(error: BaseException) -> None:
    """Let go of what the frames of a failed step hold: the step's tensors, and the round a closure in it
    captured. `traceback.clear_frames` clears each frame's locals, but a frame keeps its function, and a
    lambda's closure holds what it captured; so the exception, and each one it was raised from or during,
    also drops its traceback. Done before the allocator's cache is emptied: memory still referenced there
    stays allocated."""
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]
