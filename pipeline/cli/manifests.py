"""`dgpipe manifests`: render the kustomize overlay for a DGX node type with a build's values."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.deploy.render import NAMESPACE
from pipeline.errors import DgpipeError

app = opt.typer_app()


@app.command()
def manifests(
    target: Annotated[str, typer.Option(help="deploy target: configs/deploy/<name>.yaml (e.g. dgx-b200)")],
    image: Annotated[
        str | None,
        typer.Option(help="serving image built from the Dockerfile, pinned: REGISTRY/NAME:TAG (required)"),
    ] = None,
    output: Annotated[Path | None, opt.output("directory to write (default: BUILD_DIR/k8s)")] = None,
    build_dir: Annotated[
        Path | None, opt.build_dir("build dir whose manifest gives precision, targets and paths")
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="replicas (default: the deploy target's)")] = None,
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace")] = NAMESPACE,
    precision: Annotated[
        str | None, opt.precision("precision without --build-dir (default: the target's)")
    ] = None,
    lws_size: Annotated[
        int | None, typer.Option(help="render a LeaderWorkerSet with groups of this many pods")
    ] = None,
    no_monitoring: Annotated[
        bool, typer.Option("--no-monitoring", help="omit PodMonitor, PrometheusRule and the HPA")
    ] = False,
    smoke_prompt: Annotated[
        str | None,
        typer.Option(
            help="prompt the smoke-test Job sends (default: the one the build recorded for its model)"
        ),
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Render the kustomize overlay for a DGX node type with this build's values (kubectl kustomize)."""
    if output is None and build_dir is None:
        raise DgpipeError("--output is required without --build-dir")
    output = output or build_dir / "k8s"
    from pipeline.deploy import render as mf

    mf.check_output(output)
    values = mf.resolve(
        target,
        image,
        build_dir=build_dir,
        precision=precision,
        replicas=replicas,
        namespace=namespace,
        smoke_prompt=smoke_prompt,
        monitoring=not no_monitoring,
        lws_size=lws_size,
    )
    info = mf.write(output, values, mf.render(values))
    if build_dir is not None:
        mf.record(build_dir, output, info)
    out.show({"output": str(output), **info}, as_json, lambda _: _render(output, info))


def _render(output: Path, info: dict) -> list[str]:
    head = (
        f"{output}: {info['target']} ({info['gpu_target']}, compute.major {info['compute_major']}, "
        f"{info['precision']}) in namespace {info['namespace']}, image {info['image']}"
    )
    rows = [head, *(f"  {name:<16} {', '.join(objs)}" for name, objs in info["files"].items())]
    return [*rows, _smoke_line(info["smoke"])]


def _smoke_line(smoke: dict) -> str:
    return f"  smoke test: {smoke['prompt']!r} ({smoke['prompt_format']} format, {smoke['max_tokens']} tokens), expects {smoke['check']}"
