"""Overload against a real `dgpipe serve` (embedded model, max_batch 2, max_queue 4): the requests past the
queue are refused at once with 503 and Retry-After, counted as shed, while those admitted are answered."""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.limits import Limits
from pipeline.runtime.session import default_model_path
from pipeline.serving.repository import package
from tests._utils.availability import needs_tritonserver
from tests._utils.serve import README_PUZZLE, metric, start_serve

pytest.importorskip("fastapi")
pytestmark = [
    needs_tritonserver,
    pytest.mark.slow,
]
REQUESTS = 24


def complete(url: str, seed: int) -> tuple[int, str | None, float]:
    body = {"model": "dgpipe", "prompt": README_PUZZLE, "max_tokens": 82, "seed": seed,
            "max_denoising_steps": 8, "confidence_threshold": 0.0}  # fmt: skip
    req = urllib.request.Request(
        url + "/completions", json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status, r.headers.get("Retry-After"), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, e.headers.get("Retry-After"), time.perf_counter() - t0


def test_requests_past_a_full_queue_are_refused_at_once_and_the_rest_answered(tmp_path):
    limits = Limits(max_batch=2, max_tokens=512, max_prompt=100, max_queue=4)
    repo = package(default_model_path(), tmp_path / "repo", limits=limits)
    srv = start_serve(repo, tmp_path)
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            results = list(pool.map(lambda s: complete(srv.openai, s), range(REQUESTS)))
        shed = metric(srv.metrics, "dgpipe_requests_shed_total")
    finally:
        srv.stop()
    answered = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(answered) + len(refused) == REQUESTS, results
    # no more than the queue waits at once (the batch takes its rows as they come): the rest are shed, each
    # counted, and told to retry after a second, on this replica or another
    assert len(answered) >= limits.max_queue and refused, results
    assert shed == len(refused) and all(r[1] == "1" for r in refused)
    # refused before any work: faster than an answer
    assert statistics.median(r[2] for r in refused) < statistics.median(r[2] for r in answered)
