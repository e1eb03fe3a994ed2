"""`dgpipe bench serve --openai --url`: the request a load tool sends, read back from the frontend's own SSE
(a fake Triton behind the real app), and the figures computed from it as AIPerf and guidellm define them."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from pipeline.bench.openai_load import (
    StreamSample,
    load_body,
    read_stream,
    summarize,
    write_requests,
)
from pipeline.bench.workload import BenchRequest
from pipeline.serving.openai_api import create_app

REQ = BenchRequest(prompt="1" * 81, max_tokens=164, answer_chars=81)


class FakeTriton:
    """Two canvases of 82 tokens, as the model reports them, and the inputs it was asked with."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def __call__(self, model, inputs):
        self.calls.append(inputs)
        yield {"text_output": ["a" * 81], "num_input_tokens": [84], "num_output_tokens": [82]}
        yield {"text_output": ["b" * 81], "num_input_tokens": [84], "num_output_tokens": [164]}
        yield {
            "text_output": [""],
            "finish_reason": ["length"],
            "num_input_tokens": [84],
            "num_output_tokens": [164],
        }


def test_the_load_tool_request_is_accepted_and_its_stream_read_back_with_usage_on_every_chunk():
    fake = FakeTriton()
    client = TestClient(create_app(fake))
    r = client.post("/v1/chat/completions", json=load_body("dgpipe", REQ, 7))
    assert r.status_code == 200, r.text
    sent = fake.calls[0]
    assert sent["max_tokens"] == 164 and sent["min_tokens"] == 164 and sent["ignore_eos"] is True
    assert sent["seed"] == 7 and sent["stream"] is True
    ticks = itertools.count(1)  # the clock: 1 s per event, the request sent at 0
    s = read_stream(r.content.splitlines(keepends=True), 0.0, clock=lambda: float(next(ticks)))
    assert s.error is None and s.text == "a" * 81 + "b" * 81
    # events: role (1), canvas 1 (2), canvas 2 (3), finish (4), usage (5), then the end (6)
    assert s.ttft == 2.0 and s.gaps == [1.0] and s.latency == 6.0
    assert (s.output_tokens, s.prompt_tokens) == (164, 84)
    assert s.chunks == s.usage_chunks == 5 and s.usage_monotonic
    assert s.itl == pytest.approx((6.0 - 2.0) / 163)


def test_an_error_event_or_a_stream_without_usage_is_an_error_not_a_sample():
    err = b'data: {"error": {"message": "request ran past its deadline", "code": "timeout"}}\n'
    s = read_stream([err, b"data: [DONE]\n"], 0.0, clock=lambda: 1.0)
    assert s.error == "request ran past its deadline"
    chunk = {"choices": [{"index": 0, "delta": {"content": "12"}}]}
    s = read_stream([f"data: {json.dumps(chunk)}\n".encode(), b"data: [DONE]\n"], 0.0, clock=lambda: 1.0)
    assert s.error == "no usage in the stream" and s.text == "12"


def test_summary_counts_errors_apart_and_takes_percentiles_of_the_successful_requests():
    ok = [
        StreamSample(latency=1.0 + i, ttft=0.5 + i, output_tokens=11, chunks=3, usage_chunks=3)
        for i in range(3)
    ]
    bad = StreamSample(latency=0.1, error="HTTP 400: unknown field")
    row = summarize([*ok, bad], wall=2.0)
    assert (
        row["requests"] == 4 and row["errors"] == 1 and row["error_examples"] == ["HTTP 400: unknown field"]
    )
    assert row["requests_per_s"] == 1.5 and row["output_tokens_per_s"] == 33 / 2.0
    assert row["ttft_p50_ms"] == pytest.approx(1500.0) and row["latency_p50_ms"] == pytest.approx(2000.0)
    assert row["itl_p50_ms"] == pytest.approx(50.0)  # (latency - ttft) / (11 - 1) = 0.05 s for each
    assert row["usage_on_every_chunk"] and row["usage_monotonic"]


def test_the_requests_file_is_what_aiperf_single_turn_and_guidellm_json_file_read(tmp_path):
    path = write_requests(tmp_path / "reqs.jsonl", [REQ, BenchRequest("2" * 81, 82, 81)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"text": "1" * 81, "output_length": 164, "output_tokens_count": 164},
        {"text": "2" * 81, "output_length": 82, "output_tokens_count": 82},
    ]


def test_the_served_model_is_the_listed_one_and_a_401_names_the_key():
    import http.server
    import threading

    from pipeline.bench.openai_load import served_model
    from pipeline.errors import DgpipeError

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name for a GET
            ok = self.headers.get("Authorization") == "Bearer k3y"
            body = json.dumps({"object": "list", "data": [{"id": "tiny-chat", "object": "model"}]})
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body.encode() if ok else b'{"error": {"message": "bad key"}}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1"
    try:
        assert served_model(url, "k3y") == "tiny-chat"
        with pytest.raises(DgpipeError) as e:
            served_model(url, None)
        assert "HTTP 401" in str(e.value) and "DGPIPE_API_KEY" in (e.value.hint or "")
    finally:
        server.shutdown()
