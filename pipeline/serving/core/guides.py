"""The server's guides: size-checked, compiled in a bounded child process (guide_worker), cached.

A request's guide is checked against `max_guide_bytes` before anything compiles it, then compiled in the
compile child within `max_guide_seconds` and `max_guide_memory_mib`; a breach is a 400 naming the limit and
the child is replaced. Compiled guides are kept (least recently used out, GUIDE_CACHE per model: one model
has one tokenizer, so the key is the guide) and their compile times go to the metrics. The caller runs this
off the model's execute thread (ServingCore.accept), so health pings and other requests never wait on it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from pipeline.errors import InputError
from pipeline.sampler.constraints import GRAMMAR_TYPES, token_bytes
from pipeline.sampler.guide_size import check_guide_size
from pipeline.serving.core.guide_worker import GuideWorker
from pipeline.serving.core.metrics import Metrics
from pipeline.serving.schema import BadRequest, ServerLimits

GUIDE_CACHE = 64  # compiled guides kept per model


class Guides:
    def __init__(self, session: Any, limits: ServerLimits, metrics: Metrics, in_child: bool = True) -> None:
        """`in_child=False` compiles in this process (the size check and cache still apply): for a session
        without a tokenizer file to hand to a child, such as the tests' stand-in sessions."""
        self.session, self.limits, self.metrics, self.in_child = session, limits, metrics, in_child
        self.cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.lock = threading.Lock()
        self._worker: GuideWorker | None = None

    def worker(self) -> GuideWorker:
        if self._worker is None:
            session = self.session
            if session.tokenizer is None:
                raise BadRequest("constrained decoding needs a tokenizer.json in the checkpoint")
            vocab_size = session.checkpoint.config.text_config.vocab_size
            self._worker = GuideWorker(
                token_bytes(session.tokenizer, vocab_size),
                vocab_size,
                tuple(session.end_token_ids),
                self.limits.max_guide_memory_mib,
            )
        return self._worker

    def compiled(self, kind: str, guide: str) -> Any:
        """The compiled guide for a request; BadRequest when it is too large, refused, or past a limit."""
        limits = self.limits
        check_guide_size(kind, guide, limits.max_guide_bytes, limits.max_regex_positions, f"the {kind} guide")
        key = (kind, guide)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                self.metrics.guide_cache_hits.increment(1)
                cached = self.cache[key]
                if isinstance(cached, InputError):  # a refusal is remembered too: a re-sent hostile guide
                    raise cached  # costs nothing
                return cached
        self.metrics.guide_cache_misses.increment(1)
        start = time.perf_counter()
        try:
            if self.in_child:
                compiled = self.worker().compile(kind, guide, limits.max_guide_seconds)
            if not self.in_child or kind in GRAMMAR_TYPES:  # a grammar: checked within the limits by the
                compiled = self.session.compile_guide(kind, guide)  # child, its matcher built here
        except InputError as e:
            compiled = e
        self.metrics.guide_compile_seconds.observe(time.perf_counter() - start)
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > GUIDE_CACHE:
                self.cache.popitem(last=False)
        if isinstance(compiled, InputError):
            raise compiled
        return compiled

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
