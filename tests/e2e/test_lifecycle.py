"""The serving lifecycle against a real `dgpipe serve` (CLI, tritonserver, Python backend, OpenAI frontend):
abandoned runaway requests end by their deadline and free their slots, a killed backend stub flips
readiness and stops the server non-zero, SIGTERM and a terminal's Ctrl-C drain streams in flight and exit
0 with no shared memory left behind, a second Ctrl-C stops at once, and a killed tritonserver leaves no
process of the serve tree behind (BENCHMARKS.md, "Reliability")."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeline.limits import Limits
from pipeline.serving.lifecycle import stubs_of
from tests._utils.availability import needs_tritonserver
from tests._utils.serve import README_PUZZLE, metric, start_serve

pytest.importorskip("fastapi")
pytestmark = [
    needs_tritonserver,
    pytest.mark.slow,
]

PUZZLE = README_PUZZLE
DEADLINE_S = 6  # the runaway server's max_request_seconds


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def status(url: str, body: dict | None = None, timeout: float = 10) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def our_regions(srv) -> set[str]:
    return {s.shm_region for s in stubs_of(srv.tritonserver_pid())}


def repo_for(tmp: Path, **limits) -> Path:
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package

    return package(
        default_model_path(),
        tmp / "repo",
        limits=Limits(max_batch=8, max_tokens=512, max_prompt=100, **limits),
    )


def abandon_http(srv, n: int, body: dict) -> None:
    """n Triton generate_stream requests whose client sends, waits until they run, and closes the socket
    (Triton's HTTP endpoint notices only when it writes a response, and a runaway never commits one)."""
    raw = json.dumps(body).encode()
    host, port = srv.http.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v2/models/dgpipe/generate_stream HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw
        )
        socks.append(s)
    wait_for(lambda: metric(srv.metrics, "dgpipe_active_requests") >= n, 60, "the runaways to run")
    for s in socks:
        s.close()


def test_abandoned_runaways_end_by_deadline_or_cancel_and_a_valid_request_answers_then_a_killed_stub_stops_serve(
    tmp_path,
):
    """8 runaways (1e6 steps allowed, confidence 0: they never stop by themselves) fill every batch slot;
    their clients give up. Over HTTP the deadline frees them, over gRPC the cancel does at once; a valid
    request then answers. Last, the Python backend stub is killed: /health flips to 503 while Triton's
    own readiness still says 200, and `dgpipe serve` stops non-zero, removing the stub's shared memory."""
    from pipeline.demo import sudoku
    from pipeline.serving.client import TritonError, complete, grpc_generate

    srv = start_serve(repo_for(tmp_path, max_steps=10**6, max_request_seconds=DEADLINE_S), tmp_path)
    try:
        runaway = {"text_input": PUZZLE, "max_tokens": 82, "max_denoising_steps": 10**6}
        runaway["confidence_threshold"] = 0.0
        abandon_http(srv, 8, runaway)
        t0 = time.monotonic()
        reply = complete(srv.http, PUZZLE, max_tokens=82, exclude_input_in_output=True)
        waited = time.monotonic() - t0
        assert sudoku.is_valid_solution(PUZZLE, reply.text)
        assert waited < DEADLINE_S + 30, waited  # before: never (the slots were taken for good)
        wait_for(lambda: metric(srv.metrics, "dgpipe_requests_expired_total") == 8, 30, "8 expired")

        # gRPC: the client's cancel drops them at the model's next step, long before any deadline
        # (closing a grpc_generate stream before its final response cancels the request in Triton)
        # drafts make each stream answer at once, so its first chunk shows it under way
        streams = [
            grpc_generate(srv.grpc, {**runaway, "stream": True, "stream_drafts": True}) for _ in range(8)
        ]
        for g in streams:
            next(g)
        wait_for(lambda: metric(srv.metrics, "dgpipe_active_requests") == 8, 60, "8 gRPC runaways")
        t0 = time.monotonic()
        for g in streams:
            g.close()
        wait_for(lambda: metric(srv.metrics, "dgpipe_requests_cancelled_total") == 8, 30, "8 cancelled")
        assert time.monotonic() - t0 < DEADLINE_S  # freed by the cancel, not by the deadline
        assert sudoku.is_valid_solution(
            PUZZLE, complete(srv.grpc, PUZZLE, max_tokens=82, exclude_input_in_output=True).text
        )

        # a request's own, lower deadline: a clear error, not a hang
        with pytest.raises(TritonError, match=r"past its deadline of 0\.5 s"):
            complete(
                srv.grpc,
                PUZZLE,
                max_tokens=82,
                max_denoising_steps=10**6,
                confidence_threshold=0.0,
                timeout_s=0.5,
            )

        # the backend stub dies: readiness must say so (Triton's does not), and serve must stop
        regions = our_regions(srv)
        assert regions and status(srv.health) == 200
        (stub,) = stubs_of(srv.tritonserver_pid())
        os.kill(stub.pid, signal.SIGKILL)
        wait_for(lambda: status(srv.health) == 503, 20, "/health 503")
        assert status(f"{srv.http}/v2/health/ready") == 200  # Triton's own readiness lies
        assert srv.proc.wait(90) == 2
        assert "the model stopped answering" in srv.stderr.read_text()
        assert not any((Path("/dev/shm") / r).exists() for r in regions)
    finally:
        srv.stop()


def pgid_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


def alive(pid: int) -> bool:
    """Running (a zombie is dead: only its exit status is left for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def ctrl_c(srv) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the whole foreground process group (start_serve starts
    `dgpipe serve` as the leader of its own group)."""
    os.killpg(srv.proc.pid, signal.SIGINT)


def serve_tree(srv) -> dict[str, list[int]]:
    """tritonserver and its Python stubs, checked to be in tritonserver's own process group (so the
    terminal's signal misses them and killing that group reaches the stubs)."""
    server = srv.tritonserver_pid()
    stubs = [s.pid for s in stubs_of(server)]
    assert stubs
    assert pgid_of(server) == server != pgid_of(srv.proc.pid)
    assert all(pgid_of(stub) == server for stub in stubs)
    return {"tritonserver": [server], "stubs": stubs}


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_signal_drains_six_streams_in_flight_and_exits_0_without_shm_leftovers(tmp_path, how):
    """6 streams (3 gRPC, Triton HTTP generate_stream, 2 OpenAI SSE) of 80 fixed steps each are in flight
    when SIGTERM arrives (or Ctrl-C: SIGINT to the process group): new requests are refused (503 /
    UNAVAILABLE) and /health is 503 at once, all 6 get their final response, `dgpipe serve` exits 0 and
    its stub's shared memory is gone."""
    from pipeline.demo import sudoku
    from pipeline.serving.client import TritonError, complete

    srv = start_serve(repo_for(tmp_path), tmp_path)
    try:
        regions = our_regions(srv)
        assert regions
        long = {"max_tokens": 82, "max_denoising_steps": 80, "confidence_threshold": 0.0}
        replies: dict[str, object] = {}

        def run(name: str, url: str, **kw) -> None:
            try:
                replies[name] = complete(url, PUZZLE, stream=True, exclude_input_in_output=True, **long, **kw)
            except Exception as e:  # recorded and asserted below
                replies[name] = e

        clients = [
            threading.Thread(target=run, args=("grpc1", srv.grpc), kwargs={"seed": 1}),
            threading.Thread(target=run, args=("grpc2", srv.grpc), kwargs={"seed": 2}),
            threading.Thread(target=run, args=("http", srv.http), kwargs={"seed": 3}),
            threading.Thread(target=run, args=("openai", srv.openai), kwargs={"seed": 4}),
            threading.Thread(target=run, args=("grpc3", srv.grpc), kwargs={"seed": 5}),
            threading.Thread(target=run, args=("openai2", srv.openai), kwargs={"seed": 6}),
        ]
        for c in clients:
            c.start()
        wait_for(lambda: metric(srv.metrics, "dgpipe_active_requests") == 6, 60, "6 streams in flight")
        tree = serve_tree(srv)
        if how == "SIGTERM":
            srv.proc.send_signal(signal.SIGTERM)
        else:
            ctrl_c(srv)
        wait_for(lambda: status(srv.health) == 503, 10, "/health 503 while draining")
        refused = status(srv.openai + "/completions", {"model": "dgpipe", "prompt": PUZZLE, "max_tokens": 82})
        assert refused == 503
        with pytest.raises(TritonError, match="draining"):
            complete(srv.grpc, PUZZLE, max_tokens=82)
        assert metric(srv.metrics, "dgpipe_active_requests") > 0, (
            "the streams were still in flight when refused"
        )
        assert srv.proc.wait(120) == 0
        for c in clients:
            c.join(30)
        for name in ("grpc1", "grpc2", "http", "openai", "grpc3", "openai2"):
            reply = replies[name]
            assert not isinstance(reply, Exception), (name, reply)
            assert reply.finish_reason == "stop" and sudoku.is_valid_solution(PUZZLE, reply.text), name
        assert not any((Path("/dev/shm") / r).exists() for r in regions)
        assert "drained: nothing in flight" in srv.stderr.read_text()
        assert not any(alive(pid) for pids in tree.values() for pid in pids), tree
    finally:
        srv.stop()


def test_a_drain_that_times_out_answers_the_requests_left_as_unavailable(tmp_path):
    """Runaway streams (they never finish by themselves) outlast a 2 s drain: each is then answered with
    the model's UNAVAILABLE error (retry elsewhere), over gRPC, Triton HTTP and the OpenAI port alike,
    instead of being cut when tritonserver stops (Triton finalizes the model only after every request
    had its final response, so nothing else would answer them)."""
    from pipeline.serving.client import TritonError, complete

    srv = start_serve(repo_for(tmp_path, max_steps=10**6), tmp_path, options=["--drain-timeout", "2"])
    try:
        runaway = {"max_tokens": 82, "max_denoising_steps": 10**6, "confidence_threshold": 0.0}
        replies: dict[str, object] = {}

        def run(name: str, url: str) -> None:
            try:
                replies[name] = complete(url, PUZZLE, stream=True, **runaway)
            except Exception as e:  # the expected outcome, asserted below
                replies[name] = e

        names = {"grpc": srv.grpc, "http": srv.http, "openai": srv.openai}
        clients = [threading.Thread(target=run, args=item) for item in names.items()]
        for c in clients:
            c.start()
        wait_for(lambda: metric(srv.metrics, "dgpipe_active_requests") == 3, 60, "3 runaways in flight")
        srv.proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(60)
        assert srv.proc.wait(60) == 0
        for name in names:
            reply = replies[name]
            assert isinstance(reply, TritonError), (name, reply)
            assert "drain timed out" in str(reply) and "retry on another replica" in str(reply), (name, reply)
        assert "request(s) still in flight are answered 503" in srv.stderr.read_text()
    finally:
        srv.stop()


def test_a_second_ctrl_c_stops_at_once_and_a_killed_tritonserver_leaves_nothing_behind(tmp_path):
    """Two runaway streams (they never end by themselves) are in flight: Ctrl-C starts the drain, a second
    Ctrl-C stops at once: exit 2 within seconds, saying so, nothing of the serve tree left. Then a fresh
    `dgpipe serve` whose tritonserver is SIGKILLed: within 5 s neither tritonserver nor its Python stub is
    alive, and `dgpipe serve` has exited 2 with one line saying why."""
    from pipeline.serving.client import grpc_generate

    repo = repo_for(tmp_path, max_steps=10**6, max_request_seconds=600)
    srv = start_serve(repo, tmp_path)
    try:
        runaway = {"text_input": PUZZLE, "max_tokens": 82, "max_denoising_steps": 10**6}
        runaway |= {"confidence_threshold": 0.0, "stream": True, "stream_drafts": True}
        streams = [grpc_generate(srv.grpc, runaway) for _ in range(2)]
        for g in streams:
            next(g)
        tree = serve_tree(srv)
        ctrl_c(srv)
        wait_for(lambda: "draining" in srv.stderr.read_text(), 10, "the drain to start")
        t0 = time.monotonic()
        ctrl_c(srv)
        assert srv.proc.wait(15) == 2
        took = time.monotonic() - t0
        assert took < 10, took
        assert "stopped at once by a second signal" in srv.stderr.read_text()
        assert not any(alive(pid) for pids in tree.values() for pid in pids), tree
        for g in streams:
            g.close()
    finally:
        srv.stop()

    (tmp_path / "second").mkdir()
    srv = start_serve(repo, tmp_path / "second")
    try:
        tree = serve_tree(srv)
        regions = our_regions(srv)
        os.kill(tree["tritonserver"][0], signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not any(alive(pid) for pids in tree.values() for pid in pids), 5, "no serve tree")
        assert srv.proc.wait(5 - (time.monotonic() - t0)) == 2
        errors = [ln for ln in srv.stderr.read_text().splitlines() if "tritonserver was killed" in ln]
        assert len(errors) == 1 and "SIGKILL" in errors[0], srv.stderr.read_text()
        assert not any((Path("/dev/shm") / r).exists() for r in regions)
    finally:
        srv.stop()


def test_sigterm_after_a_hundred_cancelled_streams_exits_0_within_seconds_leaving_nothing(tmp_path):
    """100 OpenAI streams that their clients close (a third before the first chunk, the rest after it, as
    load tools' time-outs do), then SIGTERM: `dgpipe serve` exits 0 within seconds, no process of the serve
    tree and no shared memory left. (tritonserver 2.51 can keep a stream cancelled just as the model sent
    its final response and then fails its own exit on the exit timeout: after a complete drain that is not
    a failure, and the supervisor says so.)"""
    import concurrent.futures

    import openai

    srv = start_serve(repo_for(tmp_path), tmp_path)
    try:
        regions, tree = our_regions(srv), serve_tree(srv)
        client = openai.OpenAI(base_url=srv.openai, api_key="none", max_retries=0, timeout=60)

        def cancelled(i: int) -> None:
            stream = client.chat.completions.create(
                model="dgpipe",
                messages=[{"role": "user", "content": PUZZLE}],
                max_tokens=82,
                stream=True,
                seed=i,
                extra_body={"max_denoising_steps": 40},
            )
            if i % 3:
                next(iter(stream))
                time.sleep(i % 5 * 0.1)
            stream.close()

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(cancelled, range(100)))
        wait_for(
            lambda: metric(srv.metrics, "dgpipe_active_requests") == 0, 60, "the cancelled requests to end"
        )
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.stderr.read_text()[-2000:]
        assert time.monotonic() - started < 10
        assert "drained: nothing in flight" in srv.stderr.read_text()
        time.sleep(0.5)
        assert not any(alive(pid) for pids in tree.values() for pid in pids), tree
        assert not any((Path("/dev/shm") / r).exists() for r in regions)
    finally:
        srv.stop()
