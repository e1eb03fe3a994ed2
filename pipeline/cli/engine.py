"""`dgpipe engine build` / `dgpipe engine check`: the TensorRT engine commands.

`build` is also the on-node step: the Kubernetes initContainer / Job runs exactly this command in the
serving image, where an up-to-date plan is kept (pod restarts cost nothing) and a stale one is rebuilt.
Heavy imports stay inside the commands so `dgpipe engine --help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out

app = opt.typer_app(
    help="TensorRT engines: build on the target GPU node, check against this node.", no_args_is_help=True
)


@app.command("build")
def build_cmd(
    target: Annotated[
        str, typer.Option(help="GPU target: sm90 (H100/H200), sm100 (B200), sm120 (RTX Blackwell)")
    ],
    onnx: Annotated[
        Path | None, typer.Option(help="ONNX model (file or export dir); default: <build-dir>/onnx")
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="bf16, fp8, int4_awq, nvfp4; default: the target's")
    ] = None,
    output: Annotated[
        Path | None, opt.output("writes <output>/engines/<target>/; default: --build-dir")
    ] = None,
    plugins: Annotated[
        Path | None, typer.Option(help="dir holding <target>/dg_sampler.ptx; default <output>/plugins")
    ] = None,
    build_dir: Annotated[
        Path | None, opt.build_dir("a `dgpipe build` directory: defaults + manifest record")
    ] = None,
    max_batch: opt.MaxBatch = None,
    max_prompt: opt.MaxPrompt = None,
    max_context: opt.MaxContext = None,
    force: Annotated[bool, typer.Option(help="rebuild even when the plan is up to date")] = False,
    dry_run: Annotated[
        bool, typer.Option(help="validate and print the build (and its node command) only")
    ] = False,
    as_json: opt.Json = False,
) -> None:
    """Build engines/<target>/model.plan + engine.json (needs TensorRT >= 10.8 and a GPU of the target)."""
    from pipeline.engine.build_engine import build, plan_build
    from pipeline.errors import DgpipeError
    from pipeline.targets import target as get_target

    t = get_target(target)  # unknown target: refused before anything else
    precision = precision or t.default_precision
    man = None
    if build_dir is not None:
        from pipeline.builddir import load_manifest

        man = load_manifest(build_dir)
        onnx = onnx or man.path_of(build_dir, "onnx")
        plugins = plugins or man.path_of(build_dir, "plugins")
    if onnx is None:
        raise DgpipeError("--onnx is required (or --build-dir of a `dgpipe build`)")
    output = output or build_dir
    if output is None:
        raise DgpipeError("--output is required (or --build-dir)")
    plan = plan_build(
        onnx,
        t.name,
        precision,
        output,
        plugins=plugins,
        limits=opt.limits(max_batch=max_batch, max_prompt=max_prompt, max_context=max_context),
        checkpoint_sha256=man.model_sha256 if man else None,
    )
    summary = {
        "target": t.name,
        "precision": precision,
        "engine_dir": str(plan.engine_dir),
        "profiles": [p.model_dump() for p in plan.profiles],
        "node_command": plan.command(),
    }
    if dry_run:
        out.show(summary, as_json, lambda _: _describe(plan))
        return
    manifest, built = build(plan, force=force)
    if man is not None and build_dir is not None:
        from pipeline.engine.stage import record_built_engine

        record_built_engine(build_dir, manifest, output)
    summary |= {
        "built": built,
        "tensorrt_version": manifest.tensorrt_version,
        "plan_sha256": manifest.plan_sha256,
    }
    verb = "built" if built else "up to date, kept"
    out.show(
        summary,
        as_json,
        lambda _: (
            f"{plan.engine_dir / manifest.plan}: {verb} (TensorRT {manifest.tensorrt_version}, "
            f"{manifest.gpu_name}, cc {manifest.compute_capability}, {manifest.precision})"
        ),
    )


def _describe(plan) -> str:
    lines = [
        f"engine build for {plan.target.name} ({plan.target.arch}, cc {plan.target.compute_capability}), "
        f"precision {plan.precision}: {plan.engine_dir}/model.plan"
    ]
    ptx = plan.plugin.sha256[:16] if plan.plugin else "compiled at build time"
    lines.append(f"  sampler PTX: {plan.plugin_dir}/dg_sampler.ptx ({ptx})")
    for p in plan.profiles:
        dims = {k: v for k, v in p.shapes.items() if k in ("tokens", "sc_embed")}
        lines.append(f"  profile {p.name}: " + ", ".join(f"{k} {v[0]}..{v[2]}" for k, v in dims.items()))
    lines.append("  on the target node: " + " ".join(plan.command()))
    return "\n".join(lines)


@app.command("check")
def check_cmd(
    plan: Annotated[Path, typer.Option(help="engines/<target> dir, or an engines/ dir (picks this GPU's)")],
    as_json: opt.Json = False,
) -> None:
    """Check a plan's manifest against this node's TensorRT and GPU (exit 2 with the reason on mismatch)."""
    from pipeline.engine.plan_record import check_compatible, load_engine_manifest
    from pipeline.engine.probe import gpu, tensorrt_version
    from pipeline.engine.select import find_engine_dir

    g = gpu()
    engine_dir = find_engine_dir(plan, g[0] if g else None)
    manifest = load_engine_manifest(engine_dir)
    check_compatible(manifest, tensorrt_version(), g[0] if g else None, where=str(engine_dir / manifest.plan))
    result = {
        "plan": str(engine_dir / manifest.plan),
        "ok": True,
        "tensorrt": manifest.tensorrt_version,
        "compute_capability": manifest.compute_capability,
    }
    out.show(result, as_json, lambda r: f"{r['plan']}: matches this node")
