"""Shutdown: stop the runtime loop, then answer every request still queued or in flight (and every health
ping waiting) as unavailable, so no client waits on a server that is gone; new requests are refused.
Under Triton this finds nothing left (finalize comes after every final response); a host that stops the
core with requests in flight gets them answered."""

from __future__ import annotations

import contextlib
import queue
from typing import TYPE_CHECKING

from pipeline.serving.core.responses import Failure
from pipeline.serving.error_kinds import ErrorKind

if TYPE_CHECKING:
    from pipeline.serving.core.state import CoreState

SHUTTING_DOWN = "this server is shutting down: retry on another replica"
WORKER_JOIN_S = 5.0  # how long shutdown waits for the runtime loop to finish its pass


def shut_down(core: CoreState, join_s: float = WORKER_JOIN_S) -> int:
    """Stop the core; returns how many requests it answered with the shutdown error."""
    with core.admit_lock:  # a request accepted from now on is refused (ServingCore.accept)
        core.stopped = True
    core.running = False
    if core.worker is not None:
        core.worker.join(timeout=join_s)
    failure = Failure(ErrorKind.UNAVAILABLE, SHUTTING_DOWN)
    answered = 0
    while True:
        try:
            job, _ = core.inbox.get_nowait()
        except queue.Empty:
            break
        core.fail(job, failure)
        answered += 1
    for job in list(core.jobs.values()):
        core.fail(job, failure)
        answered += 1
    while not core.pings.empty():
        core.pings.get_nowait().send(failure)
    if core.worker is not None and core.worker.is_alive():
        # a pass still running (a first capture or compile can outlast the join): the runtime is its
        # loop's alone until it ends; the loop then stops, and what it finishes goes to no one
        return answered
    with contextlib.suppress(Exception):  # the runtime may be half torn down; the answers went out
        core.runtime.drop_all()
    core.update_load()
    return answered
