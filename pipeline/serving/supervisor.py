"""The `dgpipe serve` supervisor: a real tritonserver on a model repository and the OpenAI-compatible frontend
beside it, until SIGTERM or Ctrl-C, then a graceful drain.

A watchdog (pipeline/serving/lifecycle.py) pings the model through its runtime loop; /health on the OpenAI
port follows it, and when the Python backend is gone or wedged (Triton neither notices nor restarts it) the
supervisor stops tritonserver and raises, so the command exits non-zero and its own supervisor (systemd,
Kubernetes) restarts it. On SIGTERM/SIGINT it stops admitting (503, /health 503, the model refuses new
requests as UNAVAILABLE), lets requests in flight finish up to the drain timeout, stops tritonserver,
removes shared memory its stubs left, and returns. A second signal stops at once (SIGKILL to tritonserver's
process group). tritonserver and its stubs run in their own process group (pipeline/serving/server.py), so a
terminal's Ctrl-C, sent to the whole foreground group, reaches only this supervisor; when tritonserver dies
the group is killed and waited for, so `dgpipe serve` never leaves a stub behind.

Nothing here prints: `Notices.show` gets what belongs on stdout (the ready lines), `Notices.log` the
progress that belongs on stderr.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.endpoints import MODEL_NAME, OPENAI_PORT
from pipeline.errors import DgpipeError
from pipeline.serving import lifecycle
from pipeline.serving.served_model import ServedModel, from_triton, read_repository
from pipeline.serving.server import OpenAIFrontend, Ports, TritonServer

SERVED_MODEL_POLL_S = 2.0  # how often a sidecar frontend asks Triton for its model until one is ready


@dataclass(frozen=True)
class Notices:
    """Where the supervisor reports: `show` for results (stdout), `log` for progress (stderr)."""

    show: Callable[[str], None]
    log: Callable[[str], None]


@dataclass(frozen=True)
class ServeConfig:
    """One `dgpipe serve`: the repository and ports of tritonserver, the frontend's port and keys."""

    repo: Path
    ports: Ports
    workdir: Path  # tritonserver's log, backend dir and the drain file
    openai_port: int = OPENAI_PORT  # 0: no frontend
    api_key: str | None = None
    admin_key: str | None = None
    drain_timeout: float = lifecycle.DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        check_frontend_settings(self.openai_port, self.drain_timeout)


def check_frontend_settings(openai_port: int, drain_timeout: float) -> None:
    """A port the frontend can take (0 disables it) and a drain timeout within an hour."""
    if not 0 <= openai_port <= 65535:
        raise DgpipeError(f"--openai-port {openai_port}: not a port (0-65535; 0 disables the frontend)")
    if not 0 <= drain_timeout <= 3600:
        raise DgpipeError(f"--drain-timeout {drain_timeout:g}: expected 0-3600 seconds")


def stop_on_signals() -> threading.Event:
    """The first SIGINT/SIGTERM sets the event (drain, then stop); a second one stops at once. Installed
    also when started in the background, where SIGINT is ignored by default."""
    stop = threading.Event()

    def interrupt(signum, frame):
        if stop.is_set():
            # stopping at once: later signals are not to interrupt that
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    return stop


def serve(config: ServeConfig, notices: Notices) -> None:
    """tritonserver (+ the frontend) until a signal or the model failing; raises when it ended badly."""
    from pipeline.serving.schema import DRAIN_FILE_ENV

    served = read_repository(config.repo)  # the name clients, pings and the drain address; its caps
    stop = stop_on_signals()
    drain_file = config.workdir / f"draining.{config.ports.http}"  # one per server: several may share it
    drain_file.unlink(missing_ok=True)
    server = TritonServer(
        config.repo,
        config.ports,
        config.workdir,
        env={DRAIN_FILE_ENV: str(drain_file)},
        exit_timeout=lifecycle.EXIT_TIMEOUT_S,
        admin_key=config.admin_key,
    )
    notices.log(f"starting tritonserver on {config.repo} (log: {server.log}) ...")
    failure, at_once, died, watchdog, drained = None, False, None, None, False
    try:
        server.start()
        assert server.proc is not None
        watchdog = lifecycle.Watchdog(server.http_url, server.proc.pid, served.name).start()
        notices.show(f"ready  HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}")
        failure, at_once, drained = _run_until_stopped(
            config, served, server, watchdog, stop, drain_file, notices
        )
        died = server.proc.poll()  # on its own: nothing here has stopped it yet
    except KeyboardInterrupt:  # a second signal outside the loop (while starting)
        at_once = True
    finally:
        # tritonserver's whole process group: a stub of a tritonserver that died would live on
        if at_once:
            server.kill()
        else:
            server.stop()
    removed = lifecycle.remove_shm_leftovers(watchdog.regions if watchdog else set())
    if removed:
        notices.log(f"removed shared memory the Python backend left: {', '.join(removed)}")
    drain_file.unlink(missing_ok=True)
    if died is not None:
        how = f"was killed by {signal.Signals(-died).name}" if died < 0 else f"exited with code {died}"
        tail = server.tail()
        raise DgpipeError(f"tritonserver {how}; dgpipe serve stopped{': ' + tail if tail else ''}")
    if failure is not None:
        raise DgpipeError(
            f"the model stopped answering ({failure}); tritonserver was stopped so that the "
            "supervisor restarts dgpipe serve",
            f"see {server.log}",
        )
    if at_once:
        raise DgpipeError("stopped at once by a second signal: requests in flight were cut")
    if server.proc is not None and server.proc.returncode not in (0, -2, None):
        if drained and unload_timed_out(server):
            notices.log(
                f"tritonserver did not unload the model within its exit timeout ({lifecycle.EXIT_TIMEOUT_S} s) "
                "although nothing was in flight (it can hold a gRPC stream a client cancelled); its "
                "processes were stopped"
            )
            return
        raise DgpipeError(f"tritonserver exited with code {server.proc.returncode}: {server.tail()}")


def unload_timed_out(server: TritonServer) -> bool:
    """Whether tritonserver's exit failed only on its exit timeout (the model not unloaded in time).

    After a complete drain that is not a lost request: tritonserver 2.51's gRPC stream handler can keep the
    bookkeeping of a stream whose client cancelled it just as the model sent its final response (the
    cancellation then waits for a completion callback that already ran), and the model it refers to counts
    as live until the exit timeout expires. Nothing is computing; the process group is stopped anyway."""
    return "Exit timeout expired" in server.tail()


def _run_until_stopped(
    config: ServeConfig,
    served: ServedModel,
    server: TritonServer,
    watchdog: lifecycle.Watchdog,
    stop: threading.Event,
    drain_file: Path,
    notices: Notices,
) -> tuple[str | None, bool, bool]:
    """The frontend (if any) until a signal, tritonserver's exit or the watchdog's verdict; a signal drains.
    Returns the watchdog's verdict when the model stopped answering (None otherwise) and whether a second
    signal asked to stop at once, and whether a drain finished with nothing left in flight."""
    assert server.proc is not None
    frontend, failure, at_once, drained = None, None, False, False
    try:
        if config.openai_port:
            frontend = OpenAIFrontend(
                server.grpc_url,
                config.openai_port,
                config.ports.address,
                api_key=config.api_key,
                model=served.name,
                ready=watchdog.ready,
                drain_timeout=config.drain_timeout,
                max_prompt_bytes=served.limits.max_prompt_bytes,
                guide_limits=(served.limits.max_guide_bytes, served.limits.max_regex_positions),
            ).start()
            auth = "  (API key required)" if config.api_key else ""
            notices.show(f"ready  OpenAI {frontend.url}{auth}")
        notices.log("Ctrl-C or SIGTERM to drain and stop (twice: stop at once)")
        while not stop.wait(0.5) and server.proc.poll() is None and watchdog.failed is None:
            pass
        failure = watchdog.failed
        if stop.is_set():
            drained = drain(server, frontend, drain_file, config.drain_timeout, notices)
    except KeyboardInterrupt:  # a second signal
        at_once = True
        notices.log("stopping now ...")
    finally:
        watchdog.stop()
        if frontend is not None:
            frontend.stop(timeout=0 if at_once else 5)
        notices.log("stopping tritonserver ...")
    return failure, at_once, drained and not at_once


def drain(
    server: TritonServer, frontend: OpenAIFrontend | None, drain_file: Path, timeout: float, notices: Notices
) -> bool:
    """Stop admitting (frontend 503, model UNAVAILABLE), then wait for requests in flight to finish; past
    the timeout the model answers those left as unavailable. Whether nothing is in flight in the end."""
    notices.log(f"draining: new requests are refused; waiting up to {timeout:g} s for those in flight ...")
    if frontend is not None:
        frontend.drain()
    lifecycle.touch_drain_file(drain_file)
    busy = frontend.inflight if frontend is not None else (lambda: 0)
    if lifecycle.wait_drained(server.metrics_url, timeout, busy):
        notices.log("drained: nothing in flight")
        return True
    left = lifecycle.active_requests(server.metrics_url)
    notices.log(f"drain timeout: {left or 0:g} request(s) still in flight are answered 503 (retry elsewhere)")
    left = lifecycle.abort_in_flight(drain_file, server.metrics_url)
    if left:
        notices.log(f"{left:g} request(s) did not answer within {lifecycle.ABORT_WAIT_S} s: they are cut")
    return not left


def serve_frontend(
    triton_url: str,
    openai_port: int,
    address: str,
    notices: Notices,
    api_key: str | None = None,
    drain_timeout: float = lifecycle.DRAIN_TIMEOUT_S,
    model: str = MODEL_NAME,
) -> None:
    """The OpenAI frontend alone in front of a Triton already running at grpc://HOST:PORT (a pod's
    sidecar), until Ctrl-C/SIGTERM (then open streams get up to `drain_timeout`); /health pings the model
    through Triton. It has no repository: it starts at once (its port answers while Triton loads) and reads
    the `model`'s config from Triton once it is loaded (its limits, as `package` wrote them); 503 until then."""
    check_frontend_settings(openai_port, drain_timeout)
    if not triton_url.startswith("grpc://") or not openai_port:
        raise DgpipeError(
            f"--triton-url {triton_url} with --openai-port {openai_port}: expected grpc://HOST:PORT and a port"
        )
    stop = stop_on_signals()
    frontend = OpenAIFrontend(triton_url, openai_port, address, api_key=api_key, model=None,
                              drain_timeout=drain_timeout)  # fmt: skip
    frontend.ready = lambda: frontend.model is not None and lifecycle.ping(triton_url, model).ready
    if (served := from_triton(triton_url, model)) is not None:  # Triton up already: serve it from the start
        frontend.serve_model(served)
    with frontend:
        auth = "  (API key required)" if api_key else ""
        notices.show(f"ready  OpenAI {frontend.url}{auth}  ->  Triton {triton_url}")
        if served is None:  # Triton loading or unreachable: 503 until it has the model
            learn = (frontend, triton_url, model, stop, notices)
            threading.Thread(target=_learn_model, args=learn, name="served-model", daemon=True).start()
        try:
            while not stop.wait(0.5) and frontend.running():
                pass
            if stop.is_set():
                notices.log("draining the OpenAI frontend ...")
                frontend.drain()
                deadline = time.monotonic() + drain_timeout
                while frontend.inflight() and time.monotonic() < deadline:
                    time.sleep(0.2)
        except KeyboardInterrupt:
            notices.log("stopping the OpenAI frontend ...")


def _learn_model(
    frontend: OpenAIFrontend, triton_url: str, model: str, stop: threading.Event, notices: Notices
) -> None:
    """Ask Triton for the model's config until it has loaded it (or the frontend stops), then serve it."""
    while not stop.is_set():
        if (served := from_triton(triton_url, model)) is not None:
            frontend.serve_model(served)
            notices.log(f"OpenAI frontend: serving model '{model}' of {triton_url}")
            return
        stop.wait(SERVED_MODEL_POLL_S)
