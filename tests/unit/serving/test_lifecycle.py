"""pipeline/serving/lifecycle.py against real sockets (a stand-in Triton over http.server) and the Triton
model's side of it (ping, drain file, deadline) with the stand-in Python stub (tests/_utils/triton_stub.py). The real
tritonserver scenarios (stub killed, SIGTERM with streams in flight, abandoned runaways) are in
tests/e2e/test_lifecycle.py."""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import time
import types
from contextlib import contextmanager

from pipeline.serving import lifecycle, schema
from tests._utils.triton_stub import PROMPT, FakeError, FakeRequest, arr


@contextmanager
def fake_triton(answer):
    """An HTTP server whose POST/GET handler is `answer(path, body) -> (status, dict | str)`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, payload = answer(self.path, body)
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _reply

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_ping_sends_the_health_parameter_and_tells_ok_draining_and_down_apart():
    seen = []
    answers = iter(
        [
            (200, {"model_name": "dgpipe"}),
            (400, {"error": "this server is draining (shutting down): retry on another replica"}),
            (400, {"error": "Stub process 'dgpipe_0_0' is not healthy."}),  # Triton 2.51, stub killed
        ]
    )

    def answer(path, body):
        seen.append((path, json.loads(body)))
        return next(answers)

    with fake_triton(answer) as url:
        ok, draining, down = (lifecycle.ping(url) for _ in range(3))
    assert seen[0] == ("/v2/models/dgpipe/generate", {schema.HEALTH_PARAMETER: True})
    assert (ok.state, ok.ready, ok.live) == ("ok", True, True)
    assert (draining.state, draining.ready, draining.live) == ("draining", False, True)
    assert (down.state, down.ready, down.live) == ("down", False, False)
    assert "not healthy" in down.detail


def test_ping_of_a_wedged_or_absent_server_is_down():
    with fake_triton(lambda path, body: (time.sleep(2), (200, {}))[1]) as url:
        wedged = lifecycle.ping(url, timeout=0.3)
    assert wedged.state == "down" and "timed out" in wedged.detail
    gone = lifecycle.ping(url)  # the server is closed now
    assert gone.state == "down"


def test_wait_drained_follows_the_active_requests_gauge_and_the_frontends_streams():
    active = iter([3, 1, 0, 0, 0, 0])

    def metrics(path, body):
        return 200, f"# TYPE dgpipe_active_requests gauge\ndgpipe_active_requests {next(active, 0)}\n"

    streams = [1]
    with fake_triton(metrics) as url:
        threading.Timer(0.5, streams.clear).start()
        t0 = time.monotonic()
        assert lifecycle.wait_drained(url + "/metrics", 30, busy=lambda: len(streams), poll=0.05)
        assert time.monotonic() - t0 >= 0.5  # it waited for the open stream too
        assert lifecycle.active_requests(url + "/metrics") == 0
    with fake_triton(lambda path, body: (200, "dgpipe_active_requests 2\n")) as url:
        assert not lifecycle.wait_drained(url + "/metrics", 0.3, poll=0.05)  # timed out, still busy
    assert lifecycle.wait_drained(url + "/metrics", 1)  # unreachable: the server is gone, nothing in flight


def test_shm_cleanup_removes_only_our_stubs_regions(tmp_path):
    ours, theirs = lifecycle.SHM_PREFIX + "ours", lifecycle.SHM_PREFIX + "theirs"
    for name in (ours, theirs, "other"):
        (tmp_path / name).write_bytes(b"x")
    removed = lifecycle.remove_shm_leftovers({ours, lifecycle.SHM_PREFIX + "gone", "other", "../x"}, tmp_path)
    assert removed == [ours]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", theirs]


def test_drain_timeout_fits_the_grace_period_and_the_cli_uses_it():
    from pipeline.cli import health, serve

    assert lifecycle.DRAIN_TIMEOUT_S + lifecycle.EXIT_TIMEOUT_S < lifecycle.TERMINATION_GRACE_S
    assert serve.DRAIN_TIMEOUT_S is health.DRAIN_TIMEOUT_S is lifecycle.DRAIN_TIMEOUT_S


# ---- the Triton model's side ---------------------------------------------------------------------------
def test_model_answers_a_ping_from_its_runtime_loop_and_counts_no_request(model):
    req = FakeRequest({}, {schema.HEALTH_PARAMETER: True})
    model.execute([req])
    assert not req.sender.sent  # not answered by Triton's thread: by the loop
    assert model.pings.get_nowait() is req.sender
    assert model.inbox.empty() and model.m_requests.value == 0  # not a request, not in the load gauges


def test_model_refuses_new_requests_once_the_drain_file_is_touched(model, tmp_path):
    drain = tmp_path / "draining"
    model.drain_file, model.loaded_at = str(drain), time.time()
    drain.touch()
    os.utime(drain, (model.loaded_at - 60, model.loaded_at - 60))  # a previous container's file: ignored
    model.execute([FakeRequest({"text_input": arr("text_input", PROMPT)})])
    assert model.inbox.qsize() == 1
    lifecycle.touch_drain_file(drain)
    for req in (FakeRequest({"text_input": arr("text_input", PROMPT)}), FakeRequest({}, {"health_check": 1})):
        model.execute([req])
        ((response, flags),) = req.sender.sent
        assert flags == 1 and response.error.code == FakeError.UNAVAILABLE
        assert "draining" in response.error.message
    assert model.inbox.qsize() == 1 and model.m_draining.value == 1


def test_a_request_past_its_deadline_is_answered_with_an_error_naming_it(model):
    logged: list[str] = []
    sys.modules["triton_python_backend_utils"].Logger = types.SimpleNamespace(log_error=logged.append)
    model.execute(
        [FakeRequest({"text_input": arr("text_input", PROMPT), "timeout_s": arr("timeout_s", 2.0)})]
    )
    job, _ = model.inbox.get_nowait()
    now = time.perf_counter()
    assert not job.overdue(now + 100)  # queued: time in the queue does not count
    job.result = types.SimpleNamespace(admitted=now)
    assert not job.overdue(now + 1.9) and job.overdue(now + 2.1)
    cancelled = []
    model.runtime.cancel = cancelled.append
    model.jobs[job.request_id] = job
    job.expired = True
    model._on_finish(job, types.SimpleNamespace(finish_reason="cancelled", steps_per_canvas=[]))
    ((response, flags),) = job.sender.sent
    assert flags == 1 and response.error.code == FakeError.UNAVAILABLE
    assert "past its deadline of 2 s" in response.error.message and "60 s" in response.error.message
    assert model.m_expired.value == 1 and not model.jobs and "past its deadline" in logged[0]


def test_health_cli_probe_exit_codes_and_drain_touches_the_file_and_waits(tmp_path, monkeypatch):
    """What the pod runs: `dgpipe health probe [--live]` (readiness/liveness) and `dgpipe health drain`
    (preStop), against a stand-in Triton that is draining with one request still in flight."""
    from typer.testing import CliRunner

    from pipeline.cli.health import app

    active = iter([1, 1, 0])

    def answer(path, body):
        if path == "/metrics":
            return 200, f"dgpipe_active_requests {next(active, 0)}\n"
        return 400, {"error": schema.DRAINING}

    runner = CliRunner()
    drain = tmp_path / "draining"
    monkeypatch.setenv(schema.DRAIN_FILE_ENV, str(drain))
    with fake_triton(answer) as url:
        ready = runner.invoke(app, ["probe", "--url", url])
        live = runner.invoke(app, ["probe", "--live", "--url", url, "--json"])
        drained = runner.invoke(app, ["drain", "--metrics-url", url + "/metrics", "--timeout", "30"])
    assert ready.exit_code == 1 and ready.stdout.startswith("draining")
    assert live.exit_code == 0 and json.loads(live.stdout) == {
        "state": "draining",
        "detail": f"HTTP 400: {schema.DRAINING}",
        "ok": True,
    }
    assert drained.exit_code == 0 and "drained: nothing in flight" in drained.stdout and drain.is_file()
