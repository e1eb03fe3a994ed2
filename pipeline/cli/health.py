"""`dgpipe health`: probe a served model through its runtime loop, or drain it before shutdown.

For probes and hooks that cannot run `dgpipe serve` around tritonserver (the Kubernetes pod runs it
directly): `probe` is the triton container's readiness (exit 0 only when the model answers) and liveness
(`--live`: exit 0 also while draining, non-zero when the Python backend is gone or wedged, so the kubelet
restarts the container); `drain` is its preStop hook. pipeline/serving/lifecycle.py has the why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from pipeline import endpoints
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.endpoints import MODEL_NAME
from pipeline.errors import DgpipeError
from pipeline.serving.lifecycle import DRAIN_TIMEOUT_S  # stdlib only: --help stays light

app = opt.typer_app(help="Probe a served model (readiness/liveness) or drain it before shutdown.")


@app.command()
def probe(
    url: Annotated[
        str, typer.Option(help="Triton: http://HOST:PORT or grpc://HOST:PORT")
    ] = endpoints.LOCAL_HTTP_URL,
    live: Annotated[bool, typer.Option("--live", help="liveness: a draining server counts as alive")] = False,
    model: Annotated[
        str, typer.Option(help="the served model's name", envvar=endpoints.MODEL_NAME_ENV)
    ] = MODEL_NAME,
    timeout: Annotated[float, typer.Option(help="seconds the model has to answer")] = 5.0,
    as_json: opt.Json = False,
) -> None:
    """Ping the model through its runtime loop; exit 0 when ready (or, with --live, alive)."""
    from pipeline.serving.lifecycle import ping

    if not url.startswith(("http://", "grpc://")):  # a typo, not a server that is down
        raise DgpipeError(f"--url {url}: not a Triton URL", "pass http://HOST:PORT or grpc://HOST:PORT")
    health = ping(url, model, timeout)
    ok = health.live if live else health.ready
    if as_json:
        out.json_out({"state": health.state, "detail": health.detail, "ok": ok})
    else:
        out.line(f"{health.state}{': ' + health.detail if health.detail else ''}")
    if not ok:
        raise typer.Exit(1)


@app.command()
def drain(
    metrics_url: Annotated[
        str, typer.Option(help="Triton's metrics endpoint (dgpipe_active_requests)")
    ] = endpoints.LOCAL_METRICS_URL,
    drain_file: Annotated[
        Path | None,
        typer.Option(help="the model's drain file (default: $DGPIPE_DRAIN_FILE, as tritonserver got it)"),
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="seconds requests in flight get to finish")
    ] = DRAIN_TIMEOUT_S,
) -> None:
    """Make the model refuse new requests, then wait until those in flight have finished (or timeout)."""
    from pipeline.serving import lifecycle
    from pipeline.serving.schema import DRAIN_FILE_ENV

    path = drain_file or (Path(os.environ[DRAIN_FILE_ENV]) if os.environ.get(DRAIN_FILE_ENV) else None)
    if path is None:
        raise DgpipeError(f"no drain file: pass --drain-file or set {DRAIN_FILE_ENV} as for tritonserver")
    lifecycle.touch_drain_file(path)
    if lifecycle.active_requests(metrics_url) is None:  # the server is gone, or the URL is not its metrics
        out.line(
            f"drained: no metrics at {metrics_url} (server gone, or pass its --metrics-url): nothing to wait for"
        )
    elif lifecycle.wait_drained(metrics_url, timeout):
        out.line("drained: nothing in flight")
    else:
        left = lifecycle.active_requests(metrics_url)
        out.line(f"drain timeout after {timeout:g} s: {left or 0:g} request(s) still in flight answered 503")
        left = lifecycle.abort_in_flight(path, metrics_url)
        if left:
            out.line(f"{left:g} request(s) did not answer within {lifecycle.ABORT_WAIT_S} s")
