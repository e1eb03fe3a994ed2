"""A 10 MiB prompt against a real `dgpipe serve` (tiny chat checkpoint): refused with a 400 in under a
second on the OpenAI port and over Triton HTTP, before anything tokenizes it, while a bystander's requests
answer and /health stays 200 throughout."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from pipeline.serving.server import tritonserver_binary
from tests._utils.chat import write_chat_checkpoint
from tests._utils.cli import ROOT, dgpipe
from tests._utils.serve import start_serve

pytest.importorskip("fastapi")
pytestmark = [
    pytest.mark.skipif(
        tritonserver_binary() is None, reason="needs tritonserver: pip install 'dgpipe[serve]'"
    ),
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


def test_a_10_mib_prompt_is_refused_fast_while_bystanders_are_served(tmp_path):
    ckpt = write_chat_checkpoint(tmp_path / "ckpt")
    repo = tmp_path / "repo"
    dgpipe("package", "--model", str(ckpt), "--output", str(repo), "--device", "cpu", ok=True, cwd=ROOT)
    srv = start_serve(repo, tmp_path)
    try:
        health: list[int] = []
        bystander: list[int] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                try:
                    with urllib.request.urlopen(srv.health, timeout=5) as r:
                        health.append(r.status)
                except urllib.error.HTTPError as e:
                    health.append(e.code)
                time.sleep(0.1)

        def ask() -> None:
            for _ in range(4):
                chat = {"model": "dgpipe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
                bystander.append(post(srv.openai + "/chat/completions", chat)[0])

        threads = [threading.Thread(target=probe), threading.Thread(target=ask)]
        for t in threads:
            t.start()
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
        threads[1].join(120)
        stop.set()
        threads[0].join(10)
        assert all(t < 1.0 for t in timings.values()), timings
        assert bystander == [200] * 4
        assert health and set(health) == {200}
        assert srv.proc.poll() is None
    finally:
        srv.stop()
