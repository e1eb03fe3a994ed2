"""`dgpipe deploy`: apply rendered manifests with kubectl, wait for the rollout, smoke-test; roll back on failure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app()


@app.command()
def deploy(
    manifests_dir: Annotated[
        Path | None, typer.Option("--manifests", help="output of dgpipe manifests (default: BUILD_DIR/k8s)")
    ] = None,
    build_dir: Annotated[
        Path | None, opt.build_dir("build dir (its k8s/ is the default --manifests)")
    ] = None,
    upload: Annotated[
        bool, typer.Option("--upload", help="copy the build dir onto the model PVC first (needs --build-dir)")
    ] = False,
    context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
    timeout: Annotated[
        int | None,
        typer.Option(
            help="seconds to wait for the rollout (default: the progress deadline per replica the fleet may hold)",
            min=1,
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan; needs no cluster")] = False,
    allow_edited: Annotated[
        bool,
        typer.Option("--allow-edited", help="apply manifests changed after rendering (default: refuse them)"),
    ] = False,
    as_json: opt.Json = False,
) -> None:
    """Apply with kubectl (server-side), wait for the rollout, run the smoke Job; roll back on failure."""
    if upload and build_dir is None:
        raise DgpipeError("--upload needs --build-dir (the directory to copy onto the PVC)")
    if manifests_dir is None and build_dir is None:
        raise DgpipeError("--manifests or --build-dir is required", "render with dgpipe manifests first")
    from pipeline.deploy import rollout as dp

    plan = dp.make_plan(
        manifests_dir or build_dir / "k8s",
        context,
        build_dir if upload else None,
        rollout_timeout_s=timeout,
        allow_edited=allow_edited,
    )
    if plan.summary["edited"]:
        out.line(f"warning: applying edited manifests: {', '.join(plan.summary['edited'])}", err=True)
    if dry_run:
        out.show(plan.as_dict(), as_json, _render_plan)
        return
    result = dp.execute(plan, log=lambda line: out.line(line, err=as_json))
    out.show(
        result,
        as_json,
        lambda r: f"deployed {r['deployed']} in namespace {r['namespace']}: smoke test passed",
    )


def _render_plan(d: dict) -> list[str]:
    rows = [f"plan: {d['target']} -> {d['workload']} in namespace {d['namespace']} ({d['image']})"]
    rows += [f"  {name:<16} {', '.join(objs)}" for name, objs in d["objects"].items()]
    if d.get("smoke"):
        s = d["smoke"]
        rows.append(f"smoke test: {s['prompt']!r} ({s['prompt_format']} format), expects {s['check']}")
    rows += [f"{i:>2}. {step['what']}\n    $ {step['command']}" for i, step in enumerate(d["steps"], 1)]
    return rows
