"""The runtime loop, on the core's worker thread: it owns the BlockDiffusionRuntime. Each turn it submits
new requests (they join the batch at canvas boundaries), answers health pings (proof the loop is alive),
cancels requests the client abandoned or that ran past their deadline, and runs one denoise pass shared by
every request in flight. A failed pass fails the requests in flight, and the server keeps serving."""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from pipeline.serving.core import responses
from pipeline.serving.core.responses import Failure
from pipeline.serving.error_kinds import ErrorKind

if TYPE_CHECKING:
    from pipeline.serving.core.state import CoreState

POLL_S = 0.05  # how long an idle loop waits for a request before it looks at pings and deadlines again


class EngineLoop:
    def __init__(self, core: CoreState) -> None:
        self.core = core

    def run(self) -> None:
        import torch

        core = self.core
        while core.running:
            self.submit_new()
            self.answer_pings()
            core.update_load()
            self.cancel_abandoned(time.perf_counter())
            if core.runtime.busy():
                try:
                    with torch.inference_mode():
                        core.runtime.step()
                except Exception as e:  # fail the requests in flight, keep the server serving
                    core.fail_all(responses.internal_failure("during generation", e))
                if (cache := getattr(core.runtime, "prefix_cache", None)) is not None:
                    core.metrics.record_prefix_cache(cache)
                core.update_load()  # requests admitted to batch slots leave the queue

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
                    core.fail(job, Failure(ErrorKind.INVALID_REQUEST, str(e)))
                    continue
                core.jobs[job.request_id] = job
        except queue.Empty:
            pass

    def answer_pings(self) -> None:
        """Alive: this loop runs and reaches its queues."""
        while not self.core.pings.empty():
            self.core.pings.get_nowait().send(responses.ALIVE)

    def cancel_abandoned(self, now: float) -> None:
        """Cancel requests whose client went away or whose deadline passed; the runtime lets them go at
        its next step and their finish answers them (progress.on_finish)."""
        core = self.core
        for job in list(core.jobs.values()):
            if job.channel.is_cancelled():
                core.runtime.cancel(job.request_id)
            elif not job.expired and job.overdue(now):
                job.expired = True
                core.runtime.cancel(job.request_id)
