"""`dgpipe serve`: a real tritonserver on a model repository, and the OpenAI-compatible frontend beside it,
until Ctrl-C."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app()


@app.command()
def serve(
    repo: Annotated[
        Path | None,
        typer.Option(
            help="model repository (default: package the embedded model into ~/.cache/dgpipe/model_repository)"
        ),
    ] = None,
    http_port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port")] = 8002,
    address: Annotated[
        str, typer.Option(help="address to bind (0.0.0.0: every interface; mind --admin-key)")
    ] = "127.0.0.1",
    openai_port: Annotated[
        int, typer.Option(help="port of the OpenAI-compatible API (/v1/chat/completions, ...); 0 disables it")
    ] = 9000,
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
) -> None:
    """Start a real Triton server and the OpenAI-compatible API beside it, wait until ready, stop on Ctrl-C."""
    from pipeline.serving.server import OpenAIFrontend, Ports, TritonServer, docker_command

    if not 0 <= openai_port <= 65535:
        raise DgpipeError(f"--openai-port {openai_port}: not a port (0-65535; 0 disables the frontend)")
    if triton_url is not None:
        _frontend_only(triton_url, openai_port, address, api_key)
        return

    ports = Ports(http_port, grpc_port, metrics_port, address)
    if repo is None:
        from pipeline.runtime.session import default_model_path
        from pipeline.serving.repository import package as run_package

        repo = run_package(default_model_path(), opt.cache_dir() / "model_repository")
    if image:
        out.line(" ".join(docker_command(repo, ports, image)))
        return
    _stop_on_signals()
    server = TritonServer(repo, ports, opt.cache_dir() / "serve", admin_key=admin_key)
    out.line(f"starting tritonserver on {repo} (log: {server.log}) ...", err=True)
    with server:
        out.line(f"ready  HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}")
        frontend = None
        if openai_port:
            frontend = OpenAIFrontend(
                server.grpc_url, openai_port, address, api_key=api_key, ready=server.ready
            ).start()
            auth = "  (API key required)" if api_key else ""
            out.line(f"ready  OpenAI {frontend.url}{auth}")
        out.line("Ctrl-C to stop", err=True)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            out.line("stopping tritonserver ...", err=True)
        finally:
            if frontend is not None:
                frontend.stop()
    if server.proc is not None and server.proc.returncode not in (0, -2, None):
        raise DgpipeError(f"tritonserver exited with code {server.proc.returncode}: {server.tail()}")


def _stop_on_signals() -> None:
    import signal

    def interrupt(signum, frame):  # also when started in the background, where SIGINT is ignored by default
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _frontend_only(triton_url: str, openai_port: int, address: str, api_key: str | None) -> None:
    """The OpenAI frontend alone, until Ctrl-C/SIGTERM; /health follows Triton's readiness."""
    from pipeline.serving.server import OpenAIFrontend, grpc_ready

    if not triton_url.startswith("grpc://") or not openai_port:
        raise DgpipeError(
            f"--triton-url {triton_url} with --openai-port {openai_port}: expected grpc://HOST:PORT and a port"
        )
    _stop_on_signals()
    with OpenAIFrontend(
        triton_url, openai_port, address, api_key=api_key, ready=lambda: grpc_ready(triton_url)
    ) as frontend:
        auth = "  (API key required)" if api_key else ""
        out.line(f"ready  OpenAI {frontend.url}{auth}  ->  Triton {triton_url}")
        try:
            while frontend.running():
                time.sleep(1)
        except KeyboardInterrupt:
            out.line("stopping the OpenAI frontend ...", err=True)
