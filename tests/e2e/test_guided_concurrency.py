"""Concurrent guided and plain requests on a real `dgpipe serve` (embedded model, max_batch 8): guides compile
on their own threads while the runtime loop and Triton's request thread record metrics too. Unserialized,
Triton's Python-backend metric calls from those threads crashed tritonserver within a few rounds (SIGABRT
or SIGSEGV in libtriton_python.so), losing every request in flight."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.limits import Limits
from pipeline.runtime.session import default_model_path
from pipeline.serving.repository import package
from tests._utils.availability import needs_tritonserver
from tests._utils.serve import README_PUZZLE, metric, start_serve

pytestmark = [needs_tritonserver, pytest.mark.slow]
ROUNDS, PLAIN, GUIDED = 12, 8, 4
FAST = {"max_tokens": 82, "max_denoising_steps": 4, "confidence_threshold": 0.0}


def generate(url: str, body: dict) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:  # the server gone: a reset or refused connection
        return -1 if "refused" in str(e) or "reset" in str(e).lower() else -2


def test_concurrent_guided_requests_leave_the_server_serving(tmp_path):
    repo = package(default_model_path(), tmp_path / "repo", limits=Limits(max_batch=8, max_prompt=100))
    srv = start_serve(repo, tmp_path, openai=False)
    url = srv.http + "/v2/models/dgpipe/generate"
    plain = [{"text_input": README_PUZZLE, "seed": s, **FAST} for s in range(PLAIN)]
    guided = [
        {"text_input": README_PUZZLE, "seed": s, "guided_decoding_guide_type": "regex",
         "guided_decoding_guide": f"[1-{3 + s % 3}]{{81}}", **FAST}
        for s in range(GUIDED)
    ]  # fmt: skip
    statuses: list[int] = []
    try:
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(PLAIN + GUIDED) as pool:
                statuses += pool.map(lambda b: generate(url, b), plain + guided)
            assert srv.proc.poll() is None, f"dgpipe serve exited: {srv.err.read_text()[-1500:]}"
        requests = metric(srv.metrics, "dgpipe_requests_total")
    finally:
        srv.stop()
    assert statuses == [200] * (ROUNDS * (PLAIN + GUIDED)), statuses
    assert requests >= ROUNDS * (PLAIN + GUIDED)  # every one counted (a health ping counts too)
