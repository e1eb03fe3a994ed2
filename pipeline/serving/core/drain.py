"""The drain signal: once the drain file (env DGPIPE_DRAIN_FILE) is touched after this model loaded, new
requests and health pings are refused as unavailable while those in flight finish. `dgpipe serve` and the
pod's preStop hook drain through it (pipeline/serving/lifecycle.py is the other side). When the drain runs
out of time they write `ABORT` into the file: the runtime loop then answers every request still in flight
as unavailable (retry elsewhere) before tritonserver stops, which would otherwise cut them without a word
(Triton calls the model's finalize only after every request had its final response)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from pipeline.serving.schema import DRAIN_FILE_ENV

ABORT = b"abort"  # the drain file's content once the drain timed out: end what is still in flight


@dataclass
class DrainSignal:
    path: str | None  # None: this server is never drained by file
    loaded_at: float = field(default_factory=time.time)  # a drain file older than this is a previous server's

    @classmethod
    def from_env(cls) -> DrainSignal:
        return cls(os.environ.get(DRAIN_FILE_ENV))

    def draining(self) -> bool:
        """Whether the server was asked to drain (a stat per call)."""
        if not self.path:
            return False
        try:
            # file times come from the kernel's coarse clock, which can trail time.time() by a few ms: a
            # file touched right after load must not read as older (a previous container's is seconds older)
            return os.stat(self.path).st_mtime >= self.loaded_at - 1.0
        except OSError:
            return False

    def aborting(self) -> bool:
        """Whether the drain timed out: requests still in flight are to be ended (a stat, and a read of
        the few bytes of the file once draining)."""
        if not self.draining():
            return False
        try:
            with open(self.path, "rb") as f:  # type: ignore[arg-type]
                return f.read(len(ABORT) + 1) == ABORT
        except OSError:
            return False
