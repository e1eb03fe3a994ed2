"""`dgpipe bench serve`'s in-process arm: the same held-out requests through the runtime directly."""

from __future__ import annotations

from pipeline.bench.serve import REQUEST_SEED, _in_process, _summary
from pipeline.bench.workload import bench_requests
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime.session import load_session


def test_in_process_arm_serves_every_request_within_its_token_budget():
    session = load_session(EMBEDDED_MODEL, "float32", "cpu")
    reqs = bench_requests(session, 3, REQUEST_SEED, "`dgpipe bench serve`")
    samples = _in_process(session, reqs, 2)
    assert len(samples) == 3
    for s, r in zip(samples, reqs, strict=True):
        assert 0 < s["tokens"] <= r.max_tokens and 0 < s["ttfc"] <= s["latency"] + 1e-9
    summary = _summary(samples, wall=1.0)
    assert summary["requests"] == 3 and summary["tokens_per_s"] == sum(s["tokens"] for s in samples)
