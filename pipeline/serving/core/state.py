"""What the serving core's parts share, as an interface: the state and the few operations the intake, the
engine loop, progress and shutdown use. The parts are typed against this protocol, not against
`ServingCore`, so the core composes its parts and no part imports the core back."""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any, Protocol

from pipeline.serving.core.drain import DrainSignal
from pipeline.serving.core.jobs import Job
from pipeline.serving.core.metrics import Metrics
from pipeline.serving.core.responses import Failure
from pipeline.serving.schema import ServerLimits


class CoreState(Protocol):
    session: Any  # runtime.session.Session: tokenizer, prompt format, model config
    runtime: Any  # runtime.scheduler.BlockDiffusionRuntime
    limits: ServerLimits
    metrics: Metrics
    drain: DrainSignal  # the drain file: refuse new requests; end those in flight once the drain timed out
    ids: itertools.count  # request ids, unique in this model instance
    inbox: queue.Queue  # (Job, runtime Request) waiting for the runtime loop
    pings: queue.Queue  # health pings' channels, answered by the runtime loop
    jobs: dict[int, Job]  # submitted to the runtime, not yet answered
    progress: Any  # progress.Progress: the runtime's callbacks for the jobs
    guides: Any  # guides.Guides: requests' guides, compiled off the execute thread and cached
    admit_lock: threading.Lock
    running: bool
    broken: str | None  # why the GPU can run no more work in this process: every request is refused
    log_error: Any  # Callable[[str], None]: the server's error log
    stopped: bool
    worker: threading.Thread | None

    def update_load(self) -> None: ...

    def fail(self, job: Job, failure: Failure) -> None: ...

    def fail_requests(self, request_ids: list[int], failure: Failure) -> None: ...

    def fail_all(self, failure: Failure) -> None: ...
