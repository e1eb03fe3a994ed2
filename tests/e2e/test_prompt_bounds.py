"""A 10 MiB prompt against a real `dgpipe serve` (tiny chat checkpoint): refused with a 400 in under a
second on the OpenAI port and over Triton HTTP, before anything tokenizes it, while a bystander's requests
answer and /health stays 200 throughout. On the same server: a non-streamed OpenAI request whose client
goes away is cancelled in the model, not computed to its end."""

from __future__ import annotations

import json
import socket
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
BIG = "x" * (10 << 20)


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("prompt_bounds")
    ckpt = write_chat_checkpoint(tmp_path / "ckpt")
    repo = tmp_path / "repo"
    dgpipe("package", "--model", str(ckpt), "--output", str(repo), "--device", "cpu", ok=True, cwd=ROOT)
    server = start_serve(repo, tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_a_10_mib_prompt_is_refused_fast_while_bystanders_are_served(srv):
    bystander: list[int] = []

    def ask() -> None:
        for _ in range(4):
            chat = {"model": "dgpipe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            bystander.append(post(srv.openai + "/chat/completions", chat)[0])

    with health_probed(srv) as health:
        thread = threading.Thread(target=ask)
        thread.start()
        timings = {}
        for name, url, body in (
            ("openai", srv.openai + "/completions", {"model": "dgpipe", "prompt": BIG, "max_tokens": 8}),
            ("triton", srv.http + "/v2/models/dgpipe/generate", {"text_input": BIG, "max_tokens": 8}),
        ):
            start = time.monotonic()
            status, answer = post(url, body)
            timings[name] = time.monotonic() - start
            assert status in (400, 413), (name, status, answer)
            assert "max_prompt_bytes" in json.dumps(answer), answer
        thread.join(120)
    assert all(t < 1.0 for t in timings.values()), timings
    assert bystander == [200] * 4
    assert health and set(health) == {200}
    assert srv.proc.poll() is None


def wait_for(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_non_streamed_openai_request_is_cancelled_when_its_client_leaves(srv):
    """32 canvases of 16 tokens, 256 passes each (confidence 0: none settles early): ~70 s of work here; the
    client closes its connection once the request runs, and the model cancels it at its next step: the
    cancelled counter moves, the canvases counter stops and the request leaves the active gauge."""
    body = json.dumps(
        {
            "model": "dgpipe",
            "prompt": "hi",
            "max_tokens": 512,
            "ignore_eos": True,
            "max_denoising_steps": 256,
            "confidence_threshold": 0.0,
        }
    ).encode()
    cancelled = metric(srv.metrics, "dgpipe_requests_cancelled_total")
    host, port = srv.openai.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        assert wait_for(lambda: metric(srv.metrics, "dgpipe_active_requests") == 1, 30)
        left = time.monotonic()
    assert wait_for(lambda: metric(srv.metrics, "dgpipe_requests_cancelled_total") == cancelled + 1, 10)
    assert time.monotonic() - left < 3.0
    assert wait_for(lambda: metric(srv.metrics, "dgpipe_active_requests") == 0, 5)
    canvases = metric(srv.metrics, "dgpipe_canvases_total")
    time.sleep(1.0)
    assert metric(srv.metrics, "dgpipe_canvases_total") == canvases  # nothing more is computed
