"""`dgpipe serve`: a real tritonserver on a model repository, and the OpenAI-compatible frontend beside it,
until SIGTERM or Ctrl-C, then a graceful drain.

Lifecycle (pipeline/serving/lifecycle.py): a watchdog pings the model through its runtime loop; /health on
the OpenAI port follows it, and when the Python backend is gone or wedged (Triton neither notices nor
restarts it) `dgpipe serve` stops with a non-zero exit so its supervisor restarts it. On SIGTERM/SIGINT it
stops admitting (503, /health 503, the model refuses new requests as UNAVAILABLE), lets requests in flight
finish up to --drain-timeout, stops tritonserver, removes shared memory its stubs left, and exits 0.
A second signal stops at once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from pipeline import endpoints
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError
from pipeline.serving.lifecycle import DRAIN_TIMEOUT_S  # stdlib only: --help stays light

app = opt.typer_app()


@app.command()
def serve(
    repo: Annotated[
        Path | None,
        typer.Option(
            help="model repository (default: package the embedded model into ~/.cache/dgpipe/model_repository)"
        ),
    ] = None,
    http_port: Annotated[int, typer.Option(help="HTTP port")] = endpoints.HTTP_PORT,
    grpc_port: Annotated[int, typer.Option(help="gRPC port")] = endpoints.GRPC_PORT,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port")] = endpoints.METRICS_PORT,
    address: Annotated[
        str, typer.Option(help="address to bind (0.0.0.0: every interface; mind --admin-key)")
    ] = "127.0.0.1",
    openai_port: Annotated[
        int, typer.Option(help="port of the OpenAI-compatible API (/v1/chat/completions, ...); 0 disables it")
    ] = endpoints.OPENAI_PORT,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="DGPIPE_API_KEY",
            show_envvar=True,
            help="require 'Authorization: Bearer KEY' on the OpenAI port (/health stays open)",
        ),
    ] = None,
    admin_key: Annotated[
        str | None,
        typer.Option(
            envvar="DGPIPE_ADMIN_KEY",
            show_envvar=True,
            help="header 'triton-admin-key' that Triton's logging/trace/repository/shared-memory/statistics "
            "APIs require (default: a random key, i.e. closed)",
        ),
    ] = None,
    image: Annotated[
        str | None, typer.Option(help="print the NGC container command for a GPU host instead")
    ] = None,
    triton_url: Annotated[
        str | None,
        typer.Option(
            help="serve only the OpenAI API, in front of a Triton already running at grpc://HOST:PORT "
            "(the Kubernetes pod's sidecar)"
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            help="on SIGTERM/Ctrl-C: seconds requests in flight get to finish while new ones are refused "
            "(default: the pod's terminationGracePeriodSeconds minus a margin)"
        ),
    ] = DRAIN_TIMEOUT_S,
) -> None:
    """Start a real Triton server and the OpenAI-compatible API beside it, wait until ready, stop on Ctrl-C."""
    from pipeline.serving.server import OpenAIFrontend, Ports, TritonServer, docker_command

    if not 0 <= openai_port <= 65535:
        raise DgpipeError(f"--openai-port {openai_port}: not a port (0-65535; 0 disables the frontend)")
    if not 0 <= drain_timeout <= 3600:
        raise DgpipeError(f"--drain-timeout {drain_timeout:g}: expected 0-3600 seconds")
    if triton_url is not None:
        _frontend_only(triton_url, openai_port, address, api_key, drain_timeout)
        return

    ports = Ports(http_port, grpc_port, metrics_port, address)
    if repo is None:
        from pipeline.runtime.session import default_model_path
        from pipeline.serving.repository import package as run_package

        repo = run_package(default_model_path(), opt.cache_dir() / "model_repository")
    if image:
        out.line(" ".join(docker_command(repo, ports, image)))
        return
    from pipeline.serving import lifecycle
    from pipeline.serving.schema import DRAIN_FILE_ENV

    stop = _stop_on_signals()
    workdir = opt.cache_dir() / "serve"
    drain_file = workdir / f"draining.{ports.http}"  # one per server: several may share the cache
    drain_file.unlink(missing_ok=True)
    server = TritonServer(
        repo,
        ports,
        workdir,
        env={DRAIN_FILE_ENV: str(drain_file)},
        exit_timeout=lifecycle.EXIT_TIMEOUT_S,
        admin_key=admin_key,
    )
    out.line(f"starting tritonserver on {repo} (log: {server.log}) ...", err=True)
    failure = None
    with server:
        assert server.proc is not None
        watchdog = lifecycle.Watchdog(server.http_url, server.proc.pid).start()
        out.line(f"ready  HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}")
        frontend = None
        try:
            if openai_port:
                frontend = OpenAIFrontend(
                    server.grpc_url,
                    openai_port,
                    address,
                    api_key=api_key,
                    ready=watchdog.ready,
                    drain_timeout=drain_timeout,
                ).start()
                auth = "  (API key required)" if api_key else ""
                out.line(f"ready  OpenAI {frontend.url}{auth}")
            out.line("Ctrl-C or SIGTERM to drain and stop", err=True)
            while not stop.wait(0.5) and server.proc.poll() is None and watchdog.failed is None:
                pass
            failure = watchdog.failed
            if stop.is_set():
                _drain(server, frontend, drain_file, drain_timeout)
        except KeyboardInterrupt:  # a second signal
            out.line("stopping now ...", err=True)
        finally:
            watchdog.stop()
            if frontend is not None:
                frontend.stop(timeout=5)
            out.line("stopping tritonserver ...", err=True)
    removed = lifecycle.remove_shm_leftovers(watchdog.regions)
    if removed:
        out.line(f"removed shared memory the Python backend left: {', '.join(removed)}", err=True)
    drain_file.unlink(missing_ok=True)
    if failure is not None:
        raise DgpipeError(
            f"the model stopped answering ({failure}); tritonserver was stopped so that the supervisor "
            "restarts dgpipe serve",
            f"see {server.log}",
        )
    if server.proc is not None and server.proc.returncode not in (0, -2, None):
        raise DgpipeError(f"tritonserver exited with code {server.proc.returncode}: {server.tail()}")


def _drain(server, frontend, drain_file: Path, timeout: float) -> None:
    """Stop admitting (frontend 503, model UNAVAILABLE), then wait for requests in flight to finish."""
    from pipeline.serving import lifecycle

    out.line(
        f"draining: new requests are refused; waiting up to {timeout:g} s for those in flight ...", err=True
    )
    if frontend is not None:
        frontend.drain()
    lifecycle.touch_drain_file(drain_file)
    busy = frontend.inflight if frontend is not None else (lambda: 0)
    if lifecycle.wait_drained(server.metrics_url, timeout, busy):
        out.line("drained: nothing in flight", err=True)
    else:
        left = lifecycle.active_requests(server.metrics_url)
        out.line(f"drain timeout: {left or 0:g} request(s) still in flight are cut", err=True)


def _stop_on_signals() -> threading.Event:
    """The first SIGINT/SIGTERM sets the event (drain, then stop); a second one stops at once. Installed
    also when started in the background, where SIGINT is ignored by default."""
    import signal

    stop = threading.Event()

    def interrupt(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    return stop


def _frontend_only(
    triton_url: str, openai_port: int, address: str, api_key: str | None, drain_timeout: float
) -> None:
    """The OpenAI frontend alone, until Ctrl-C/SIGTERM (then open streams get up to `drain_timeout`);
    /health pings the model through Triton (pipeline/serving/lifecycle.py)."""
    from pipeline.serving import lifecycle
    from pipeline.serving.server import OpenAIFrontend

    if not triton_url.startswith("grpc://") or not openai_port:
        raise DgpipeError(
            f"--triton-url {triton_url} with --openai-port {openai_port}: expected grpc://HOST:PORT and a port"
        )
    stop = _stop_on_signals()
    with OpenAIFrontend(
        triton_url,
        openai_port,
        address,
        api_key=api_key,
        ready=lambda: lifecycle.ping(triton_url).ready,
        drain_timeout=drain_timeout,
    ) as frontend:
        auth = "  (API key required)" if api_key else ""
        out.line(f"ready  OpenAI {frontend.url}{auth}  ->  Triton {triton_url}")
        try:
            while not stop.wait(0.5) and frontend.running():
                pass
            if stop.is_set():
                out.line("draining the OpenAI frontend ...", err=True)
                frontend.drain()
                deadline = time.monotonic() + drain_timeout
                while frontend.inflight() and time.monotonic() < deadline:
                    time.sleep(0.2)
        except KeyboardInterrupt:
            out.line("stopping the OpenAI frontend ...", err=True)
