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


Target = Annotated[
    str, typer.Option(help="GPU target: sm90 (H100/H200), sm100 (B200), sm120 (RTX Blackwell)")
]
Onnx = Annotated[Path | None, typer.Option(help="ONNX model (file or export dir); default: <build-dir>/onnx")]
Precision = Annotated[str | None, opt.precision("nvfp4, fp8, int4_awq or bf16; default: the target's")]
Output = Annotated[Path | None, opt.output("writes <output>/engines/<target>/; default: --build-dir")]
Plugins = Annotated[
    Path | None, typer.Option(help="dir holding <target>/dg_sampler.ptx; default <output>/plugins")
]
BuildDir = Annotated[Path | None, opt.build_dir("a `dgpipe build` directory: defaults + manifest record")]
Force = Annotated[bool, typer.Option(help="rebuild even when the plan is up to date")]
DryRun = Annotated[bool, typer.Option(help="validate and print the build (and its node command) only")]


@app.command("build")
def build_cmd(
    target: Target,
    onnx: Onnx = None,
    precision: Precision = None,
    output: Output = None,
    plugins: Plugins = None,
    build_dir: BuildDir = None,
    max_batch: opt.MaxBatch = None,
    max_prompt: opt.MaxPrompt = None,
    max_context: opt.MaxContext = None,
    force: Force = False,
    dry_run: DryRun = False,
    as_json: opt.Json = False,
) -> None:
    """Build engines/<target>/model.plan + engine.json (needs TensorRT >= 10.9 and a GPU of the target)."""
    from pipeline.engine.stage import EngineBuild, build_one_engine

    request = EngineBuild(
        target=target,
        onnx=onnx,
        precision=precision,
        output=output,
        plugins=plugins,
        build_dir=build_dir,
        limits=opt.limits(max_batch=max_batch, max_prompt=max_prompt, max_context=max_context),
        force=force,
        dry_run=dry_run,
    )
    out.stage(build_one_engine(request), as_json)


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
