"""The server's Prometheus metrics: counters, load gauges (set on every change: 0 when idle, never left at
the last busy value) and histograms. The core records them through a MetricFactory the adapter provides
(Triton's MetricFamily in the Python backend), so the names and buckets are written once, here."""

from __future__ import annotations

import threading
from typing import Any, Protocol

# Histogram buckets (upper bounds; Prometheus adds +Inf): seconds for latencies, steps for steps per canvas.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


class Metric(Protocol):
    """One metric; a counter is incremented, a gauge set, a histogram observed."""

    def increment(self, value: float) -> None: ...
    def set(self, value: float) -> None: ...
    def observe(self, value: float) -> None: ...


class MetricFactory(Protocol):
    def counter(self, name: str, description: str) -> Metric: ...
    def gauge(self, name: str, description: str) -> Metric: ...
    def histogram(self, name: str, description: str, buckets: tuple[float, ...]) -> Metric: ...


class Metrics:
    """Every metric the server exports, by what it counts."""

    def __init__(self, make: MetricFactory) -> None:
        self.factory = make  # kept: it may own what its metrics need alive (Triton's metric families)
        self.requests = make.counter("dgpipe_requests_total", "Generate requests accepted")
        self.rejected = make.counter("dgpipe_requests_rejected_total", "Requests refused as invalid")
        self.shed = make.counter(
            "dgpipe_requests_shed_total", "Requests refused because max_queue requests already waited (503)"
        )
        self.cancelled = make.counter("dgpipe_requests_cancelled_total", "Requests the client cancelled")
        self.expired = make.counter(
            "dgpipe_requests_expired_total",
            "Requests ended by their deadline (max_request_seconds/timeout_s)",
        )
        self.failed = make.counter(
            "dgpipe_requests_failed_total",
            "Requests answered with an internal error (a failure of the server's own); Triton's "
            "nv_inference_request_failure never counts them: a decoupled model's error responses count as successes",
        )
        self.draining = make.gauge("dgpipe_draining", "1 once the server drains: new requests are refused")
        self.canvases = make.counter("dgpipe_canvases_total", "Canvases committed")
        self.steps = make.counter("dgpipe_denoise_steps_total", "Denoise steps over all canvases")
        self.tokens = make.counter("dgpipe_generated_tokens_total", "Tokens generated")
        self.active = make.gauge(
            "dgpipe_active_requests", "Requests accepted and not yet answered (in the batch or queued)"
        )
        self.queued = make.gauge("dgpipe_queued_requests", "Accepted requests waiting for a batch slot")
        self.out_of_memory = make.counter(
            "dgpipe_out_of_memory_total",
            "Denoise steps that ran out of GPU memory (their batch answered 503)",
        )
        self.rows_allowed = make.gauge(
            "dgpipe_batch_rows_allowed",
            "Rows a denoise pass admits at most: max_batch, less after out of memory",
        )
        self._rows_allowed: int | None = None
        self.guide_cache_hits = make.counter(
            "dgpipe_guide_cache_hits_total", "Constrained-decoding guides found compiled in the cache"
        )
        self.guide_cache_misses = make.counter(
            "dgpipe_guide_cache_misses_total",
            "Constrained-decoding guides compiled (or refused) in the compile child",
        )
        self._prefix_cache(make)
        self._histograms(make)
        self._lock = threading.Lock()
        self._load = (0, 0)
        self.active.set(0)
        self.queued.set(0)

    def _prefix_cache(self, make: MetricFactory) -> None:
        self.prefix_lookup_tokens = make.counter(
            "dgpipe_prefix_cache_lookup_tokens_total", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hit_tokens = make.counter(
            "dgpipe_prefix_cache_hit_tokens_total",
            "Prompt tokens whose K/V came from the prefix cache (hit rate: this over lookup tokens)",
        )
        self.prefix_evicted = make.counter(
            "dgpipe_prefix_cache_evicted_blocks_total", "Prompt blocks evicted from the prefix cache (LRU)"
        )
        self.prefix_bytes = make.gauge("dgpipe_prefix_cache_bytes", "Bytes of K/V the prefix cache holds")
        self._prefix_seen = (0, 0, 0)

    def record_prefix_cache(self, cache: Any) -> None:
        """Bring the prefix-cache metrics up to the cache's cumulative counts (runtime.prefix_cache.PrefixCache;
        called by the runtime loop after each step)."""
        s = cache.stats
        now = (s.lookup_tokens, s.hit_tokens, s.evicted_blocks)
        if now != self._prefix_seen:
            for metric, new, old in zip(
                (self.prefix_lookup_tokens, self.prefix_hit_tokens, self.prefix_evicted),
                now,
                self._prefix_seen,
            ):
                if new > old:
                    metric.increment(new - old)
            self._prefix_seen = now
            self.prefix_bytes.set(cache.nbytes)

    def _histograms(self, make: MetricFactory) -> None:
        self.time_to_first_canvas = make.histogram(
            "dgpipe_time_to_first_canvas_seconds",
            "From acceptance to a request's first committed canvas",
            LATENCY_BUCKETS,
        )
        self.canvas_latency = make.histogram(
            "dgpipe_canvas_latency_seconds",
            "Time per committed canvas (the first one from acceptance, the others from the previous canvas)",
            LATENCY_BUCKETS,
        )
        self.steps_per_canvas = make.histogram(
            "dgpipe_steps_per_canvas", "Denoise steps per committed canvas", STEP_BUCKETS
        )
        self.guide_compile_seconds = make.histogram(
            "dgpipe_guide_compile_seconds",
            "Compile time of a constrained-decoding guide that was not cached (limit: max_guide_seconds)",
            LATENCY_BUCKETS,
        )
        self.request_latency = make.histogram(
            "dgpipe_request_latency_seconds",
            "From acceptance to the final response of a request answered with a result",
            REQUEST_BUCKETS,
        )

    def record_rows_allowed(self, rows: int) -> None:
        """Set the rows gauge to the runtime's `rows_allowed` (called by the runtime loop after each step;
        only a change is written)."""
        if rows != self._rows_allowed:
            self._rows_allowed = rows
            self.rows_allowed.set(rows)

    def set_load(self, active: int, queued: int) -> None:
        """Set the load gauges (called by either thread on every change; only a change is written)."""
        with self._lock:
            if (active, queued) != self._load:
                self._load = (active, queued)
                self.active.set(active)
                self.queued.set(queued)
