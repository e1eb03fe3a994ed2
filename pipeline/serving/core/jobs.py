"""A request the core accepted, from intake to its final answer: what it asked for and how far it got."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.runtime.output_text import OutputText
from pipeline.serving.core.deadlines import overdue
from pipeline.serving.core.responses import Channel


@dataclass
class Job:
    channel: Channel
    request_id: int
    prompt_ids: list[int]
    flags: dict[str, bool]
    output: OutputText  # its text so far, cut at its stop words
    tokens: int = 0
    canvases: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_canvas: float | None = None
    last_canvas: float | None = None  # when the previous canvas was committed (None: none yet)
    failed: bool = False  # answered with an error: nothing more is sent
    timeout_s: float = float("inf")  # its deadline, from when it got a batch slot
    expired: bool = False  # cancelled by its deadline: answered with an error, not a result
    result: Any = None  # the runtime's Result once submitted (its `admitted` time: when it got a slot)
    # return_log_probs: Result.logprobs entries read so far, and the token entries not yet sent
    logprobs_read: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def overdue(self, now: float) -> bool:
        admitted = self.result.admitted if self.result is not None else 0.0
        return overdue(admitted, self.timeout_s, now)
