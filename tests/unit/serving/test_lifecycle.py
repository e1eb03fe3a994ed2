"""pipeline/serving/lifecycle.py against real sockets (a stand-in Triton over http.server); the Triton model's
side of it (ping, drain file, deadline) is tested in test_schema.py with its stand-in Python stub. The real
tritonserver scenarios (stub killed, SIGTERM with streams in flight, abandoned runaways) are in
tests/e2e/test_lifecycle.py."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from contextlib import contextmanager

from pipeline.serving import lifecycle, schema


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
        t0 = time.monotonic()  # before the timer starts: the stream closes at least 0.5 s after t0
        threading.Timer(0.5, streams.clear).start()
        assert lifecycle.wait_drained(url + "/metrics", 30, busy=lambda: len(streams), poll=0.05)
        assert time.monotonic() - t0 >= 0.5  # it waited for the open stream too
        assert lifecycle.active_requests(url + "/metrics") == 0
    with fake_triton(lambda path, body: (200, "dgpipe_active_requests 2\n")) as url:
        assert not lifecycle.wait_drained(url + "/metrics", 0.3, poll=0.05)  # timed out, still busy
    assert lifecycle.wait_drained(url + "/metrics", 1)  # unreachable: the server is gone, nothing in flight


def test_a_timed_out_drain_asks_the_model_to_answer_what_is_left(tmp_path):
    """The drain file says drain when touched and abort once `abort_in_flight` wrote it; a drain file of
    a previous server (older than the model's load) says neither."""
    from pipeline.serving.core.drain import DrainSignal

    path = tmp_path / "draining.8000"
    signal_ = DrainSignal(str(path))
    assert not signal_.draining() and not signal_.aborting()
    lifecycle.touch_drain_file(path)
    assert signal_.draining() and not signal_.aborting()
    with fake_triton(lambda p, body: (200, "dgpipe_active_requests 0\n")) as url:
        assert lifecycle.abort_in_flight(path, url + "/metrics", wait_s=1) == 0
    assert signal_.aborting()
    os.utime(path, (time.time() - 60, time.time() - 60))
    assert not DrainSignal(str(path)).aborting()  # a previous server's file
    # the next server's drain (the file survives a container restart): a drain, not an abort
    restarted = DrainSignal(str(path))
    lifecycle.touch_drain_file(path)
    assert restarted.draining() and not restarted.aborting()


def test_active_requests_sums_the_series_of_every_model_instance():
    """Each model instance labels its own gauge (Triton hands instances asking for the same labels one
    series): a drain must wait for all of them, not read the first line."""
    text = (
        "# HELP dgpipe_active_requests Requests accepted and not yet answered\n"
        "# TYPE dgpipe_active_requests gauge\n"
        'dgpipe_active_requests{model="dgpipe",model_instance="dgpipe_0_0",version="1"} 0\n'
        'dgpipe_active_requests{model="dgpipe",model_instance="dgpipe_0_1",version="1"} 3 1700000000000\n'
        "dgpipe_active_requests_other 9\n"
    )
    with fake_triton(lambda path, body: (200, text)) as url:
        assert lifecycle.active_requests(url + "/metrics") == 3
        assert not lifecycle.wait_drained(url + "/metrics", 0.3, poll=0.05)
    with fake_triton(lambda path, body: (200, "nv_gpu_utilization 0\n")) as url:
        assert lifecycle.active_requests(url + "/metrics") is None  # not the model's metrics


def test_shm_cleanup_removes_only_our_stubs_regions(tmp_path):
    ours, theirs = lifecycle.SHM_PREFIX + "ours", lifecycle.SHM_PREFIX + "theirs"
    for name in (ours, theirs, "other"):
        (tmp_path / name).write_bytes(b"x")
    removed = lifecycle.remove_shm_leftovers({ours, lifecycle.SHM_PREFIX + "gone", "other", "../x"}, tmp_path)
    assert removed == [ours]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", theirs]


def test_drain_timeout_fits_the_grace_period_and_the_cli_uses_it():
    import inspect

    from pipeline.cli import health, serve

    # after the drain: the model answers what is left, then tritonserver exits, all within the grace period
    assert lifecycle.ABORT_WAIT_S + lifecycle.EXIT_TIMEOUT_S < lifecycle.DRAIN_MARGIN_S
    assert lifecycle.DRAIN_TIMEOUT_S + lifecycle.DRAIN_MARGIN_S <= lifecycle.TERMINATION_GRACE_S
    # the options' defaults: `dgpipe health drain --timeout` and `dgpipe serve --drain-timeout`
    assert inspect.signature(health.drain).parameters["timeout"].default == lifecycle.DRAIN_TIMEOUT_S
    assert inspect.signature(serve.serve).parameters["drain_timeout"].default == lifecycle.DRAIN_TIMEOUT_S


def test_health_probe_pings_the_model_the_pod_environment_names(monkeypatch):
    """Kubernetes runs exec probes without $(VAR) expansion, so the probe takes the served model's name from
    $DGPIPE_MODEL_NAME (set from dgpipe-config); --model still wins."""
    from typer.testing import CliRunner

    from pipeline.cli.health import app
    from pipeline.endpoints import MODEL_NAME_ENV

    paths = []

    def answer(path, body):
        paths.append(path)
        return 404, {"error": f"unknown model {path.split('/')[3]!r}"}

    monkeypatch.setenv(MODEL_NAME_ENV, "tiny-chat")
    with fake_triton(answer) as url:
        CliRunner().invoke(app, ["probe", "--url", url])
        CliRunner().invoke(app, ["probe", "--url", url, "--model", "other"])
    assert paths == ["/v2/models/tiny-chat/generate", "/v2/models/other/generate"]


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
    # nothing answers at the metrics URL: said so (a wrong --metrics-url read as "nothing in flight")
    gone = runner.invoke(app, ["drain", "--metrics-url", "http://127.0.0.1:9/metrics", "--timeout", "30"])
    assert gone.exit_code == 0 and "drained: no metrics at http://127.0.0.1:9/metrics" in gone.stdout


def test_a_port_another_server_listens_on_is_refused_before_tritonserver_starts(tmp_path, monkeypatch):
    """Readiness is probed by URL: with another server on the HTTP port, it answered for the new one, which
    printed "ready" (and its clients were served by the other) until tritonserver failed to bind. The taken
    port is named before anything starts; a port nobody listens on is free."""
    import socket

    import pytest

    from pipeline.errors import DgpipeError
    from pipeline.serving import server

    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\n')
    spawned = []
    monkeypatch.setattr(server, "spawn", lambda *a, **kw: spawned.append(a))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        free = [socket.socket() for _ in range(2)]
        for s in free:
            s.bind(("127.0.0.1", 0))
        grpc, metrics = (s.getsockname()[1] for s in free)
        for s in free:
            s.close()  # free again, as a port a stopped server left behind
        ports = server.Ports(http=taken, grpc=grpc, metrics=metrics)
        with pytest.raises(DgpipeError, match=rf"port {taken} \(--http-port\) on 127.0.0.1 is taken"):
            server.TritonServer(repo, ports, tmp_path).start(timeout=1)
        assert spawned == []
        server.Ports(http=grpc, grpc=metrics, metrics=grpc).check_free()
        server.Ports(http=grpc, grpc=metrics, metrics=grpc, address="").check_free()  # every interface, as ""
        with pytest.raises(DgpipeError, match=r"--address nohost\.invalid"):
            server.Ports(http=grpc, grpc=metrics, metrics=grpc, address="nohost.invalid").check_free()


def test_the_watchdog_waits_out_a_long_step_but_not_a_dead_stub(monkeypatch):
    """A runtime loop that answers no ping may be in one long step (a kernel compiled on first use): the
    server stops only after `wedged_after_s` of it (readiness says down at once); stubs that are gone cannot
    come back, and `down_after` pings say so."""
    stubs = [lifecycle.Stub(1, "region")]
    answer = [lifecycle.Health("down", "timed out", answered=False)]
    monkeypatch.setattr(lifecycle, "stubs_of", lambda pid: list(stubs))
    monkeypatch.setattr(lifecycle, "ping", lambda url, model: answer[0])

    def watch(wedged_after_s: float, pings: int = 10) -> lifecycle.Watchdog:
        w = lifecycle.Watchdog("http://x", 1, period=0.01, wedged_after_s=wedged_after_s).start()
        deadline = time.monotonic() + 10
        while w.failed is None and w._thread.is_alive() and time.monotonic() < deadline and pings:
            time.sleep(0.05)
            pings -= 1
        return w

    busy = watch(wedged_after_s=30.0)
    assert busy.failed is None and not busy.ready() and busy.health.detail == "timed out"
    busy.stop()
    wedged = watch(wedged_after_s=0.1, pings=200)
    assert wedged.failed == "timed out"
    # the model answered, refusing (a lost GPU: "restart the server"): final, whatever wedged_after_s says
    answer[0] = lifecycle._classify(
        "HTTP 400: [unavailable] the GPU can run no more work: restart the server"
    )
    refused = watch(wedged_after_s=30.0, pings=200)
    assert refused.failed is not None and "restart the server" in refused.failed
    stubs.clear()
    answer[0] = lifecycle.Health("down", "timed out", answered=False)
    gone = watch(wedged_after_s=30.0, pings=200)
    assert gone.failed == f"no {lifecycle.STUB_NAME} process is running"
