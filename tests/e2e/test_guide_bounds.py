"""Hostile constrained-decoding guides against a real `dgpipe serve` (tiny chat checkpoint, packaged with
`--max-guide-seconds 3 --max-guide-bytes 65536`): a 2^18-state regex and a 50,000-repeat regex are refused
with a 400 naming the limit (the first once its compile child runs past its time, the second by its
unrolled size, before it compiles), an oversized guide at once, and the
100 x 100 x 100 `$ref` fan-out schema is served (llguidance compiles it lazily in milliseconds); meanwhile
a bystander's 8 requests answer 200 at their usual latency and /health stays 200. A guide sent twice is
compiled once (the cache metrics)."""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests._utils.availability import needs_tritonserver
from tests._utils.chat import write_chat_checkpoint
from tests._utils.cli import ROOT, dgpipe
from tests._utils.serve import health_probed, metric, start_serve

pytest.importorskip("fastapi")
pytestmark = [
    needs_tritonserver,
    pytest.mark.slow,
]
GUIDE_SECONDS = 3


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict, float]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), time.monotonic() - start


def chat(**extra) -> dict:
    return {"model": "dgpipe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}


def fan_out_schema(n: int = 100) -> dict:
    """Three levels of n properties, each a $ref to the next level: n^3 paths from 8 KB of JSON."""
    props = lambda ref: {f"p{i}": {"$ref": f"#/$defs/{ref}"} for i in range(n)}
    return {
        "$defs": {
            "a": {"type": "object", "properties": props("b")},
            "b": {"type": "object", "properties": props("c")},
            "c": {"type": "integer"},
        },
        "type": "object",
        "properties": props("a"),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guides")
    ckpt = write_chat_checkpoint(tmp / "ckpt")
    repo = tmp / "repo"
    limits = ["--max-guide-seconds", str(GUIDE_SECONDS), "--max-guide-bytes", "65536"]
    dgpipe(
        "package", "--model", str(ckpt), "--output", str(repo), "--device", "cpu", *limits, ok=True, cwd=ROOT
    )
    srv = start_serve(repo, tmp)
    yield srv
    srv.stop()


def solo_latency(srv) -> float:
    return statistics.median(post(srv.openai + "/chat/completions", chat())[2] for _ in range(4))


def while_bystanders(srv, body: dict) -> tuple[int, dict, float, list[float], list[int]]:
    """Send `body` while a bystander sends 8 plain requests one after another and /health is probed every
    0.1 s: (status, answer, seconds, the bystander's latencies, every health status)."""
    latencies: list[float] = []
    statuses: list[int] = []

    def bystander() -> None:
        for _ in range(8):
            status, _, seconds = post(srv.openai + "/chat/completions", chat())
            statuses.append(status)
            latencies.append(seconds)

    with health_probed(srv) as health:
        thread = threading.Thread(target=bystander)
        thread.start()
        status, answer, seconds = post(srv.openai + "/chat/completions", body)
        thread.join(120)
    assert statuses == [200] * 8, statuses
    return status, answer, seconds, latencies, health


def test_a_guide_past_its_compile_limit_is_a_400_and_nobody_else_waits(server):
    solo = solo_latency(server)
    hostile = chat(guided_regex="(1|2)*1(1|2){16}")  # a 2^18-state automaton
    status, answer, seconds, latencies, health = while_bystanders(server, hostile)
    assert status == 400, answer
    message = answer["error"]["message"]
    assert "max_guide_seconds" in message or "max_guide_memory_mib" in message, message
    assert seconds < GUIDE_SECONDS + 3, seconds
    assert health and set(health) == {200}, health
    # the compile child runs at the lowest priority: the bystander keeps its pace
    assert statistics.median(latencies) <= 2 * solo + 0.5, (solo, latencies)
    assert server.proc.poll() is None
    status, again, seconds = post(server.openai + "/chat/completions", hostile)  # the refusal is cached
    assert (status, again) == (400, answer) and seconds < 1


def test_a_regex_too_large_unrolled_is_refused_before_it_compiles(server):
    status, answer, seconds = post(server.openai + "/chat/completions", chat(guided_regex="[1-9]{50000}"))
    assert status == 400 and "max_regex_positions" in answer["error"]["message"], answer
    assert seconds < 1


def test_an_oversized_guide_is_refused_before_it_compiles(server):
    big = "|".join(f"item{i}" for i in range(20000))  # ~130 KB, over the 64 KiB cap
    status, answer, seconds = post(server.openai + "/chat/completions", chat(guided_regex=big))
    assert status == 400 and "max_guide_bytes" in answer["error"]["message"], answer
    assert seconds < 2


def test_the_fan_out_schema_is_served_and_a_repeated_guide_compiles_once(server):
    """llguidance expands `$ref`s lazily: the 10^6-path schema compiles in milliseconds and its output is
    JSON a client can read, so it is served (200), not refused; the bystander is unaffected."""
    schema = fan_out_schema()
    assert 7000 < len(json.dumps(schema, separators=(",", ":"))) < 9000
    solo = solo_latency(server)
    body = chat(guided_json=schema, max_tokens=64)
    status, answer, seconds, latencies, health = while_bystanders(server, body)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert seconds < GUIDE_SECONDS + 3
    assert health and set(health) == {200}
    assert statistics.median(latencies) <= 2 * solo + 0.5, (solo, latencies)
    hits = metric(server.metrics, "dgpipe_guide_cache_hits_total")
    misses = metric(server.metrics, "dgpipe_guide_cache_misses_total")
    assert post(server.openai + "/chat/completions", body)[0] == 200
    assert metric(server.metrics, "dgpipe_guide_cache_hits_total") == hits + 1
    assert metric(server.metrics, "dgpipe_guide_cache_misses_total") == misses
