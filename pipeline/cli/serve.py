"""`dgpipe serve`: a real tritonserver on a model repository, and the OpenAI-compatible frontend beside it,
until SIGTERM or Ctrl-C, then a graceful drain (the supervisor: pipeline/serving/supervisor.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline import endpoints
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.serving.lifecycle import DRAIN_TIMEOUT_S  # stdlib only: --help stays light

app = opt.typer_app()

Repo = Annotated[
    Path | None,
    typer.Option(
        help="model repository (default: package the embedded model into ~/.cache/dgpipe/serve/model_repository)"
    ),
]
HttpPort = Annotated[int, typer.Option(help="HTTP port", min=1, max=65535)]
GrpcPort = Annotated[int, typer.Option(help="gRPC port", min=1, max=65535)]
MetricsPort = Annotated[int, typer.Option(help="Prometheus metrics port", min=1, max=65535)]
Address = Annotated[str, typer.Option(help="address to bind (0.0.0.0: every interface; mind --admin-key)")]
OpenAIPort = Annotated[
    int,
    typer.Option(
        help="port of the OpenAI-compatible API (/v1/chat/completions, ...); 0 disables it", min=0, max=65535
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="DGPIPE_API_KEY",
        show_envvar=True,
        help="require 'Authorization: Bearer KEY' on the OpenAI port (/health stays open)",
    ),
]
AdminKey = Annotated[
    str | None,
    typer.Option(
        envvar="DGPIPE_ADMIN_KEY",
        show_envvar=True,
        help="header 'triton-admin-key' that Triton's logging/trace/repository/shared-memory/statistics "
        "APIs require (default: a random key, i.e. closed); prefer the environment variable: `ps` shows options",
    ),
]
Image = Annotated[str | None, typer.Option(help="print the NGC container command for a GPU host instead")]
TritonUrl = Annotated[
    str | None,
    typer.Option(
        help="serve only the OpenAI API, in front of a Triton already running at grpc://HOST:PORT "
        "(the Kubernetes pod's sidecar)"
    ),
]
SidecarModel = Annotated[
    str,
    typer.Option(
        "--name",
        help="with --triton-url: the served model's name (`dgpipe package --name`); its limits are read "
        "from Triton",
    ),
]
DrainTimeout = Annotated[
    float,
    typer.Option(
        help="on SIGTERM/Ctrl-C: seconds requests in flight get to finish while new ones are refused "
        "(default: the pod's terminationGracePeriodSeconds minus a margin)"
    ),
]


@app.command()
def serve(
    repo: Repo = None,
    http_port: HttpPort = endpoints.HTTP_PORT,
    grpc_port: GrpcPort = endpoints.GRPC_PORT,
    metrics_port: MetricsPort = endpoints.METRICS_PORT,
    address: Address = "127.0.0.1",
    openai_port: OpenAIPort = endpoints.OPENAI_PORT,
    api_key: ApiKey = None,
    admin_key: AdminKey = None,
    image: Image = None,
    triton_url: TritonUrl = None,
    model: SidecarModel = endpoints.MODEL_NAME,
    drain_timeout: DrainTimeout = DRAIN_TIMEOUT_S,
) -> None:
    """Start a real Triton server and the OpenAI-compatible API beside it, wait until ready, stop on Ctrl-C."""
    from pipeline.serving import supervisor
    from pipeline.serving.server import Ports, docker_command

    notices = supervisor.Notices(show=out.line, log=lambda text: out.line(text, err=True))
    if triton_url is not None:
        supervisor.serve_frontend(triton_url, openai_port, address, notices, api_key, drain_timeout, model)
        return
    supervisor.check_frontend_settings(openai_port, drain_timeout)
    ports = Ports(http_port, grpc_port, metrics_port, address)
    if repo is None:
        from pipeline.runtime.session import default_model_path
        from pipeline.serving.repository import package as run_package

        # its own dir under serve's: `dgpipe package`'s default output (cache/model_repository) is the user's
        repo = run_package(default_model_path(), opt.cache_dir() / "serve" / "model_repository")
    if image:
        out.line(" ".join(docker_command(repo, ports, image)))
        return
    config = supervisor.ServeConfig(
        repo=repo,
        ports=ports,
        workdir=opt.cache_dir() / "serve",
        openai_port=openai_port,
        api_key=api_key,
        admin_key=admin_key,
        drain_timeout=drain_timeout,
    )
    supervisor.serve(config, notices)
