"""The serving core as one object: the adapter hands it each request (`accept`, on the transport's thread)
and starts and stops it; the core answers through the request's channel. It holds the state its parts
share: the session and runtime, the server's limits, the queues, the jobs in flight and the metrics."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.serving.core.drain import DrainSignal
from pipeline.serving.core.engine_loop import EngineLoop
from pipeline.serving.core.guides import Guides
from pipeline.serving.core.intake import InputGetter, Intake
from pipeline.serving.core.jobs import Job
from pipeline.serving.core.metrics import Metrics
from pipeline.serving.core.progress import Progress
from pipeline.serving.core.responses import Channel, Failure, refusal
from pipeline.serving.core.shutdown import SHUTTING_DOWN, shut_down
from pipeline.serving.error_kinds import ErrorKind
from pipeline.serving.schema import DRAINING, GUIDE_INPUTS, HEALTH_PARAMETER, INPUT, QUEUE_FULL, ServerLimits


class ServingCore:
    def __init__(
        self,
        session: Any,
        runtime: Any,
        limits: ServerLimits,
        metrics: Metrics,
        drain: DrainSignal | None = None,
        log_error: Callable[[str], None] = lambda message: None,
        guides: Guides | None = None,
    ) -> None:
        self.session, self.runtime, self.limits, self.metrics = session, runtime, limits, metrics
        self.drain = drain or DrainSignal(None)
        self.log_error = log_error
        self.ids = itertools.count(1)
        self.inbox: queue.Queue = queue.Queue()  # (Job, runtime Request) waiting for the runtime loop
        # health pings' channels: answered by the runtime loop, so a wedged loop fails them (apart from
        # the inbox, so they never show in the load gauges)
        self.pings: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # submitted to the runtime, not yet answered
        self.intake, self.progress, self.loop = Intake(self), Progress(self), EngineLoop(self)
        self.loop.record_rows_allowed()
        self.guides = guides or Guides(session, limits, metrics)
        # guided requests are taken in here (their guide compiled, or found cached) so that the transport's
        # thread, which also carries health pings and every other request, never waits on a compile
        self.guided_intake = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dgpipe-guides")
        self.admit_lock = threading.Lock()
        self.taking_in = 0  # guided requests handed to `guided_intake`, not yet queued or refused
        self.running = self.stopped = False
        self.worker: threading.Thread | None = None
        # why the GPU can run no more work in this process (set by the engine loop): every request and
        # health ping is refused from then on, so the server gets restarted
        self.broken: str | None = None

    def start(self) -> None:
        self.running = True
        self.worker = threading.Thread(target=self.loop.run, name="dgpipe-runtime", daemon=True)
        self.worker.start()

    def stop(self) -> int:
        """Stop and answer every request still queued or in flight; returns how many were answered."""
        answered = shut_down(self)
        self.guides.close()  # a compile under way ends now; its request is answered as shutting down
        # requests still waiting for an intake thread run (fast: nothing compiles now) and are answered so
        self.guided_intake.shutdown(wait=False)
        return answered

    def accept(self, get: InputGetter, parameters: Mapping[str, Any], channel: Channel) -> None:
        """Take one request: refused (draining, shutting down, invalid), a health ping, or queued."""
        try:
            if self.broken is not None:  # health pings too: the watchdog or the kubelet restarts the server
                channel.send(Failure(ErrorKind.UNAVAILABLE, self.broken))
                return
            if self.drain.draining():
                self.metrics.draining.set(1)
                channel.send(Failure(ErrorKind.UNAVAILABLE, DRAINING))
                return
            if HEALTH_PARAMETER in parameters:
                self._queue(self.pings, channel, channel)
                return
            if self._shed(channel):
                return
            if any(get(name) is not None for name in GUIDE_INPUTS):
                inputs = {name: get(name) for name in INPUT}  # read now: the transport's request may go
                with self.admit_lock:
                    self.taking_in += 1
                self.guided_intake.submit(self._take_guided, inputs.get, dict(parameters), channel)
                return
        except Exception as e:  # a bad request is answered alone; the batch keeps going
            self.metrics.rejected.increment(1)
            channel.send(refusal("accepting the request", e))
            return
        self._take(get, parameters, channel)

    def _shed(self, channel: Channel) -> bool:
        """Refuse at once, before any work, as unavailable (retry, here later or on another replica) when
        `max_queue` requests already wait (0: no cap)."""
        waiting = self.waiting()
        if not self.limits.max_queue or waiting < self.limits.max_queue:
            return False
        self.metrics.shed.increment(1)
        channel.send(Failure(ErrorKind.UNAVAILABLE, QUEUE_FULL.format(waiting)))
        return True

    def waiting(self) -> int:
        """Requests accepted and waiting for a batch slot: queued for the runtime loop, in its queue, or
        being taken in off the transport's thread (guided: their guide compiles)."""
        return self.inbox.qsize() + len(self.runtime.waiting) + self.taking_in

    def _take_guided(self, get: InputGetter, parameters: Mapping[str, Any], channel: Channel) -> None:
        try:
            self._take(get, parameters, channel)
        finally:
            with self.admit_lock:
                self.taking_in -= 1

    def _take(self, get: InputGetter, parameters: Mapping[str, Any], channel: Channel) -> None:
        """Build the request (checks, prompt, guide) and queue it for the runtime loop, or refuse it."""
        try:
            if self._queue(self.inbox, self.intake.build(get, parameters, channel), channel):
                self.metrics.requests.increment(1)
                self.update_load()
        except Exception as e:  # a bad request is answered alone; the batch keeps going
            if self.stopped:  # its guide's compile child went with the shutdown: not the request's fault
                channel.send(Failure(ErrorKind.UNAVAILABLE, SHUTTING_DOWN))
                return
            self.metrics.rejected.increment(1)
            channel.send(refusal("building the request", e))

    def _queue(self, into: queue.Queue, item: Any, channel: Channel) -> bool:
        """Queue unless the core is shut down (then the request is answered as unavailable)."""
        with self.admit_lock:
            if not self.stopped:
                into.put(item)
                return True
        channel.send(Failure(ErrorKind.UNAVAILABLE, SHUTTING_DOWN))
        return False

    def update_load(self) -> None:
        """Set the load gauges from the current state; called on every change of it (by either thread)."""
        inbox = self.inbox.qsize()
        self.metrics.set_load(inbox + len(self.jobs), inbox + len(self.runtime.waiting))

    def fail(self, job: Job, failure: Failure) -> None:
        """Answer one request with an error; nothing more is sent to it."""
        self.log_error(f"dgpipe: request {job.request_id}: {failure.message}")
        job.failed = True
        self.jobs.pop(job.request_id, None)
        self.update_load()
        self._count_failed(failure, 1)
        job.channel.send(failure)

    def fail_requests(self, request_ids: list[int], failure: Failure) -> None:
        """Answer these requests with the error (the rows of a failed pass, already dropped by the runtime)."""
        self.log_error(failure.message)
        for request_id in request_ids:
            if (job := self.jobs.pop(request_id, None)) is not None:
                job.failed = True
                self._count_failed(failure, 1)
                job.channel.send(failure)
        self.update_load()

    def _count_failed(self, failure: Failure, requests: int) -> None:
        """Internal errors feed the request-failure alert (k8s/base/prometheusrule.yaml); the client's own
        faults, deadlines and unavailability have counters of their own."""
        if failure.kind is ErrorKind.INTERNAL and requests:
            self.metrics.failed.increment(requests)

    def fail_all(self, failure: Failure) -> None:
        """Answer every request submitted to the runtime with the error and drop them from it."""
        self.log_error(failure.message)
        self._count_failed(failure, len(self.jobs))
        for job in list(self.jobs.values()):
            job.failed = True
            job.channel.send(failure)
        self.jobs.clear()
        self.runtime.drop_all()
        self.update_load()
