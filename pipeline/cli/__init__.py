"""The `dgpipe` command. Heavy imports (torch, transformers, modelopt, tritonclient) live inside the
commands that need them, so `dgpipe --help` stays instant."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from pipeline import __version__
from pipeline.builddir import MODEL_NAME, EngineLimits
from pipeline.errors import DgpipeError

app = typer.Typer(
    help="DiffusionGemma deployment pipeline: load -> quantize -> export -> engines -> Triton -> Kubernetes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Accuracy evaluations.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (results as JSON, a table and PNG plots).", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")
# TensorRT engine commands live in their own module (pipeline/cli/engine.py), which imports only typer
from pipeline.cli.engine import engine_app  # noqa: E402

app.add_typer(engine_app, name="engine")

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", "-m", help="checkpoint dir (HF layout); default: the embedded Sudoku model"),
]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")]
DtypeOpt = Annotated[str, typer.Option(help="float32, bfloat16, float16 or auto (bf16 on GPU, fp32 on CPU)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"dgpipe {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_cb, is_eager=True, help="print the version")
    ] = False,
) -> None:
    pass


def _print_json(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


# ---- doctor ---------------------------------------------------------------------------------------
@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """Check what this machine has for each stage, with install hints for what is missing."""
    from pipeline.doctor import as_json as to_json
    from pipeline.doctor import run_checks

    checks = run_checks()
    if as_json:
        _print_json(to_json(checks))
        return
    width = max(len(c.name) for c in checks)
    for c in checks:
        status = typer.style("ok     ", fg="green") if c.ok else typer.style("missing", fg="red")
        line = f"{status} {c.name:<{width}}  {c.detail}"
        if not c.ok:
            line += f"  ({c.needed_for}: {c.hint})"
        typer.echo(line)


# ---- generate -------------------------------------------------------------------------------------
@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt text (a puzzle for the embedded Sudoku model)")],
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option(help="stop after this many new tokens (no overshoot)")] = 256,
    steps: Annotated[int | None, typer.Option("--steps", help="max denoising steps per canvas")] = None,
    entropy_bound: Annotated[
        float | None, typer.Option(help="EB-sampler entropy budget per step (> 0)")
    ] = None,
    t_min: Annotated[float | None, typer.Option(help="temperature at the last step")] = None,
    t_max: Annotated[float | None, typer.Option(help="temperature at the first step")] = None,
    confidence_threshold: Annotated[
        float | None, typer.Option(help="adaptive stop below this mean entropy; 0 = fixed steps")
    ] = None,
    stability_threshold: Annotated[
        int | None, typer.Option(help="steps the argmax canvas must stay unchanged to stop")
    ] = None,
    seed: Annotated[int, typer.Option(help="request seed (counter-based RNG)")] = 0,
    canvas_length: Annotated[int | None, typer.Option(help="override the checkpoint's canvas length")] = None,
    infill: Annotated[
        str | None, typer.Option(help="canvas template: '_' marks a free position, other text is pinned")
    ] = None,
    no_infill: Annotated[bool, typer.Option("--no-infill", help="do not pin a Sudoku's givens")] = False,
    stream: Annotated[
        bool, typer.Option("--stream", help="print each committed canvas as it completes")
    ] = False,
    drafts: Annotated[bool, typer.Option("--drafts", help="show the canvas refining step by step")] = False,
    url: Annotated[
        str | None, typer.Option(help="ask a Triton server instead: http://HOST:8000 or grpc://HOST:8001")
    ] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Generate with block diffusion, in-process or from a Triton server (--url)."""
    overrides = {
        "max_denoising_steps": steps,
        "entropy_bound": entropy_bound,
        "t_min": t_min,
        "t_max": t_max,
        "confidence_threshold": confidence_threshold,
        "stability_threshold": stability_threshold,
    }
    if max_tokens < 1:
        raise DgpipeError(f"--max-tokens must be >= 1 (got {max_tokens})")
    if url:
        from pipeline.cli.generation import run_generate_remote

        run_generate_remote(url, prompt, max_tokens, overrides, seed, infill, stream, drafts, as_json)
        return
    from pipeline.cli.generation import run_generate

    run_generate(
        prompt,
        model=model,
        max_tokens=max_tokens,
        overrides=overrides,
        seed=seed,
        canvas_length=canvas_length,
        infill=infill,
        use_default_infill=not no_infill,
        stream=stream,
        drafts=drafts,
        dtype=dtype,
        device=device,
        as_json=as_json,
    )


# ---- export ---------------------------------------------------------------------------------------
@app.command()
def export(
    model: ModelOpt = None,
    output: Annotated[Path | None, typer.Option(help="ONNX dir to write (replaced atomically)")] = None,
    build_dir: Annotated[
        Path | None, typer.Option(help="build dir: default output + manifest record")
    ] = None,
    precision_from_checkpoint: Annotated[
        bool, typer.Option(help="quantized checkpoints export Q/DQ (else dequantized float weights)")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Export model + sampler step as ONNX (opset 21, dgpipe::SampleRows/SampleAccept; docs/onnx.md)."""
    from pipeline.onnx.stage import run_export
    from pipeline.runtime.session import default_model_path

    run_export(model or default_model_path(), output, build_dir, precision_from_checkpoint, as_json)


# ---- build --------------------------------------------------------------------------------------------
@app.command()
def build(
    model: ModelOpt = None,
    precision: Annotated[str, typer.Option(help="nvfp4, fp8, int4_awq or bf16")] = "nvfp4",
    target: Annotated[
        list[str] | None,
        typer.Option(help="GPU target (sm90, sm100, sm120; repeatable); default: all that run the precision"),
    ] = None,
    build_dir: Annotated[Path, typer.Option(help="where every stage writes (build_manifest.json)")] = Path(
        "runs/build"
    ),
    calib_size: Annotated[int, typer.Option(help="calibration prompts")] = 64,
    calib_data: Annotated[Path | None, typer.Option(help='JSONL calibration prompts ({"text": ...})')] = None,
    max_batch: Annotated[int, typer.Option(help="engine profile / Triton batch")] = EngineLimits.max_batch,
    max_prompt: Annotated[int, typer.Option(help="longest prompt, tokens")] = EngineLimits.max_prompt,
    max_context: Annotated[
        int, typer.Option(help="prompt + generated tokens per request")
    ] = EngineLimits.max_context,
    as_json: JsonOpt = False,
) -> None:
    """Run every stage: quantize -> export ONNX -> sampler PTX + TensorRT engines (here, or the step for the
    target node) -> Triton model repository, recorded in BUILD_DIR/build_manifest.json."""
    from rich.console import Console

    from pipeline.build import BuildOptions, run_build
    from pipeline.runtime.session import default_model_path

    opts = BuildOptions(
        model=model or default_model_path(),
        precision=precision,
        build_dir=build_dir,
        targets=[t for item in target or [] for t in item.split(",") if t],
        calib_size=calib_size,
        calib_data=calib_data,
        max_batch=max_batch,
        max_prompt=max_prompt,
        max_context=max_context,
    )
    console = Console(stderr=as_json)
    with console.status("building", spinner="dots"):
        summary = run_build(opts, say=lambda line: console.print(line, highlight=False))
    if as_json:
        _print_json(summary)


# ---- package / serve -------------------------------------------------------------------------------
@app.command()
def package(
    model: ModelOpt = None,
    output: Annotated[Path, typer.Option(help="model repository to write (replaced atomically)")] = Path(
        "runs/model_repository"
    ),
    name: Annotated[str, typer.Option(help="model name in the repository")] = MODEL_NAME,
    max_batch: Annotated[
        int, typer.Option(help="requests that share each denoise pass")
    ] = EngineLimits.max_batch,
    max_tokens_limit: Annotated[
        int, typer.Option(help="largest max_tokens a request may ask for")
    ] = EngineLimits.max_tokens,
    max_prompt_tokens: Annotated[
        int, typer.Option(help="longest prompt accepted, in tokens")
    ] = EngineLimits.max_prompt,
    device: DeviceOpt = "auto",
    engines: Annotated[
        Path | None, typer.Option(help="TensorRT engines dir (<target>/model.plan + engine.json) to ship")
    ] = None,
) -> None:
    """Write a Triton model repository (Python backend, decoupled) that serves the checkpoint."""
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package as run_package

    out = run_package(
        model or default_model_path(),
        output,
        name,
        max_batch,
        max_tokens_limit,
        max_prompt_tokens,
        device,
        engines=engines,
    )
    typer.echo(f"model repository: {out} (model '{name}')")


@app.command()
def serve(
    repo: Annotated[
        Path | None, typer.Option(help="model repository (default: package the embedded model)")
    ] = None,
    http_port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port")] = 8002,
    address: Annotated[str, typer.Option(help="address to bind")] = "0.0.0.0",
    image: Annotated[
        str | None, typer.Option(help="print the NGC container command for a GPU host instead")
    ] = None,
) -> None:
    """Start a real Triton server on the repository, wait until it is ready, stop on Ctrl-C."""
    from pipeline.serving.server import Ports, TritonServer, docker_command

    ports = Ports(http_port, grpc_port, metrics_port, address)
    if repo is None:
        from pipeline.runtime.session import default_model_path
        from pipeline.serving.repository import package as run_package

        repo = run_package(default_model_path(), Path("runs/model_repository"))
    if image:
        typer.echo(" ".join(docker_command(repo, ports, image)))
        return
    import signal

    def interrupt(signum, frame):  # also when started in the background, where SIGINT is ignored by default
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    server = TritonServer(repo, ports, Path("runs/serve"))
    typer.echo(f"starting tritonserver on {repo} (log: {server.log}) ...", err=True)
    with server:
        typer.echo(f"ready  HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}")
        typer.echo("Ctrl-C to stop", err=True)
        try:
            while server.proc is not None and server.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            typer.echo("stopping tritonserver ...", err=True)
    if server.proc is not None and server.proc.returncode not in (0, -2, None):
        raise DgpipeError(f"tritonserver exited with code {server.proc.returncode}: {server.tail()}")


# ---- manifests / deploy (Kubernetes) --------------------------------------------------------------
@app.command()
def manifests(
    target: Annotated[str, typer.Option(help="deploy target: configs/deploy/<name>.yaml (e.g. dgx-b200)")],
    image: Annotated[
        str | None, typer.Option(help="serving image built from the Dockerfile, pinned: REGISTRY/NAME:TAG")
    ] = None,
    output: Annotated[Path | None, typer.Option(help="directory to write (default: BUILD_DIR/k8s)")] = None,
    build_dir: Annotated[
        Path | None, typer.Option(help="build dir whose manifest gives precision, targets and paths")
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="replicas (default: the deploy target's)")] = None,
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace")] = "dgpipe",
    precision: Annotated[
        str | None, typer.Option(help="precision without --build-dir (default: the target's)")
    ] = None,
    lws_size: Annotated[
        int | None, typer.Option(help="render a LeaderWorkerSet with groups of this many pods")
    ] = None,
    no_monitoring: Annotated[
        bool, typer.Option("--no-monitoring", help="omit PodMonitor, PrometheusRule and the HPA")
    ] = False,
    smoke_prompt: Annotated[str, typer.Option(help="prompt the smoke-test Job sends")] = "Hello",
    as_json: JsonOpt = False,
) -> None:
    """Render the kustomize overlay for a DGX node type with this build's values (kubectl kustomize)."""
    from pipeline.deploy import render as mf

    if output is None and build_dir is None:
        raise DgpipeError("--output is required without --build-dir")
    output = output or build_dir / "k8s"
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
    if as_json:
        _print_json({"output": str(output), **info})
        return
    typer.echo(
        f"{output}: {info['target']} ({info['gpu_target']}, compute.major {info['compute_major']}, "
        f"{info['precision']}) in namespace {info['namespace']}, image {info['image']}"
    )
    for name, objs in info["files"].items():
        typer.echo(f"  {name:<16} {', '.join(objs)}")


@app.command()
def deploy(
    manifests_dir: Annotated[
        Path | None, typer.Option("--manifests", help="output of dgpipe manifests (default: BUILD_DIR/k8s)")
    ] = None,
    build_dir: Annotated[
        Path | None, typer.Option(help="build dir (its k8s/ is the default --manifests)")
    ] = None,
    upload: Annotated[
        bool, typer.Option("--upload", help="copy the build dir onto the model PVC first (needs --build-dir)")
    ] = False,
    context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
    timeout: Annotated[
        int | None, typer.Option(help="seconds to wait for the rollout (default: engine build + load budget)")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan; needs no cluster")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Apply with kubectl (server-side), wait for the rollout, run the smoke Job; roll back on failure."""
    from pipeline.deploy import rollout as dp

    if upload and build_dir is None:
        raise DgpipeError("--upload needs --build-dir (the directory to copy onto the PVC)")
    if manifests_dir is None and build_dir is None:
        raise DgpipeError("--manifests or --build-dir is required", "render with dgpipe manifests first")
    plan = dp.make_plan(
        manifests_dir or build_dir / "k8s", context, build_dir if upload else None, rollout_timeout_s=timeout
    )
    if dry_run:
        if as_json:
            _print_json(plan.as_dict())
            return
        d = plan.as_dict()
        typer.echo(f"plan: {d['target']} -> {d['workload']} in namespace {d['namespace']} ({d['image']})")
        for name, objs in d["objects"].items():
            typer.echo(f"  {name:<16} {', '.join(objs)}")
        for i, step in enumerate(d["steps"], 1):
            typer.echo(f"{i:>2}. {step['what']}\n    $ {step['command']}")
        return
    result = dp.execute(plan, log=lambda line: typer.echo(line, err=as_json))
    if as_json:
        _print_json(result)
    else:
        typer.echo(f"deployed {result['deployed']} in namespace {result['namespace']}: smoke test passed")


# ---- eval -----------------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError as e:
        raise DgpipeError(f"--givens {text!r}: expected LO-HI, e.g. 45-61") from e
    if not 17 <= lo <= hi <= 81:
        raise DgpipeError(f"--givens {text}: need 17 <= LO <= HI <= 81")
    return lo, hi


@eval_app.command("sudoku")
def eval_sudoku_cmd(
    model: ModelOpt = None,
    n: Annotated[int, typer.Option(help="held-out puzzles")] = 200,
    givens: Annotated[str, typer.Option(help="givens range LO-HI")] = "",
    decode: Annotated[
        str, typer.Option(help="diffusion or ar (left-to-right with the KV cache)")
    ] = "diffusion",
    no_infill: Annotated[
        bool, typer.Option("--no-infill", help="do not pin the givens in the canvas")
    ] = False,
    steps: Annotated[int | None, typer.Option(help="max denoising steps")] = None,
    entropy_bound: Annotated[float | None, typer.Option(help="EB-sampler bound")] = None,
    confidence_threshold: Annotated[float | None, typer.Option(help="0 = fixed steps")] = None,
    seed: Annotated[int, typer.Option(help="puzzle-set seed")] = 20_000,
    batch: Annotated[int, typer.Option(help="puzzles per batch")] = 50,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    onnx: Annotated[
        Path | None, typer.Option(help="run the exported ONNX dir in onnxruntime (CPU) instead of PyTorch")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Solve rate, constraint-valid rate, steps per canvas and tokens/s on held-out puzzles."""
    from pipeline.cli.generation import run_eval_sudoku

    if decode not in ("diffusion", "ar"):
        raise DgpipeError(f"--decode {decode!r}: choose diffusion or ar")
    if n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {n})")
    run_eval_sudoku(
        model=model,
        n=n,
        givens=parse_range(givens) if givens else None,
        decode=decode,
        infill=not no_infill,
        overrides={
            "max_denoising_steps": steps,
            "entropy_bound": entropy_bound,
            "confidence_threshold": confidence_threshold,
        },
        seed=seed,
        batch=batch,
        dtype=dtype,
        device=device,
        as_json=as_json,
        onnx=onnx,
    )


# ---- train ----------------------------------------------------------------------------------------
@app.command()
def train(
    out: Annotated[Path, typer.Option(help="output checkpoint dir (HF layout)")] = Path("runs/sudoku-tiny"),
    minutes: Annotated[float, typer.Option(help="wall-clock training budget")] = 118.0,
    max_steps: Annotated[
        int | None, typer.Option(help="step budget (whichever of minutes/steps ends first)")
    ] = None,
    config: Annotated[str, typer.Option(help="configs/models/<name>.yaml")] = "sudoku-tiny",
    givens: Annotated[str, typer.Option(help="final givens range LO-HI of the curriculum")] = "45-61",
    batch_size: Annotated[int, typer.Option(help="examples per step")] = 64,
    lr: Annotated[float, typer.Option(help="peak learning rate")] = 2e-3,
    seed: Annotated[int, typer.Option(help="init, data and noise seed")] = 0,
    resume: Annotated[Path | None, typer.Option(help="continue from this checkpoint's weights")] = None,
    eval_every: Annotated[float, typer.Option(help="minutes between held-out evaluations")] = 15.0,
) -> None:
    """Train the embedded Sudoku DiffusionGemma (diffusion + causal-LM objectives, curriculum, symmetries)."""
    from pipeline.demo.train import TrainConfig
    from pipeline.demo.train import train as run_train

    lo, hi = parse_range(givens)
    cfg = TrainConfig(
        model=config,
        minutes=minutes,
        givens=(lo, hi),
        eval_givens=(lo, hi),
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        eval_every_minutes=eval_every,
    )
    run_train(cfg, out, resume=resume, log=lambda row: typer.echo(json.dumps(row)))


# ---- bench ----------------------------------------------------------------------------------------
@bench_app.command("local")
def bench_local(
    model: ModelOpt = None,
    runs: Annotated[int, typer.Option(help="repetitions (medians are reported)")] = 5,
    batch: Annotated[int, typer.Option(help="prompts per run")] = 1,
    reference: Annotated[
        bool, typer.Option(help="also time transformers' generate on the same checkpoint")
    ] = True,
    out: Annotated[Path, typer.Option(help="directory for JSON and PNG results")] = Path("runs/bench-local"),
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """In-process speed: ms per denoise pass, passes per canvas, tokens/s; diffusion vs AR vs transformers."""
    from pipeline.bench.local import run_bench_local

    run_bench_local(
        model=model,
        runs=runs,
        batch=batch,
        reference=reference,
        out=out,
        dtype=dtype,
        device=device,
        as_json=as_json,
    )


@bench_app.command("sweep")
def bench_sweep(
    model: ModelOpt = None,
    bounds: Annotated[str, typer.Option(help="comma-separated entropy bounds")] = "0.03,0.1,0.3,1,3",
    steps: Annotated[str, typer.Option(help="comma-separated max denoising steps")] = "2,4,8,16,48",
    n: Annotated[int, typer.Option(help="puzzles per point")] = 100,
    givens: Annotated[str, typer.Option(help="givens range LO-HI (default: the model's)")] = "",
    out: Annotated[Path, typer.Option(help="directory for JSON and PNG")] = Path("runs/bench-sweep"),
    as_json: JsonOpt = False,
) -> None:
    """Sudoku solve rate against mean steps per canvas over entropy bound x max steps (Pareto curve)."""
    from pipeline.bench.suite import run_sweep

    try:
        b = [float(x) for x in bounds.split(",")]
        st = [int(x) for x in steps.split(",")]
    except ValueError as e:
        raise DgpipeError("--bounds and --steps take comma-separated numbers") from e
    if n < 1 or min(b) <= 0 or min(st) < 1:
        raise DgpipeError("need --n >= 1, bounds > 0 and steps >= 1")
    run_sweep(model, b, st, n, parse_range(givens) if givens else None, out, as_json)


@bench_app.command("serve")
def bench_serve(
    url: Annotated[
        str | None,
        typer.Option(help="HTTP URL of a running server (default: start one on the embedded model)"),
    ] = None,
    grpc_url: Annotated[str | None, typer.Option(help="gRPC URL of the same server")] = None,
    concurrency: Annotated[str, typer.Option(help="comma-separated concurrency levels")] = "1,2,4,8",
    requests: Annotated[int, typer.Option(help="requests per level and protocol")] = 32,
    out: Annotated[Path, typer.Option(help="directory for JSON and PNG")] = Path("runs/bench-serve"),
    as_json: JsonOpt = False,
) -> None:
    """Triton over HTTP and gRPC at several concurrencies, with the same requests in-process alongside."""
    from pipeline.bench.suite import run_bench_serve

    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError as e:
        raise DgpipeError(f"--concurrency {concurrency!r}: expected comma-separated integers") from e
    if url:
        run_bench_serve(url, grpc_url, levels, requests, out, as_json)
        return
    import socket

    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package as run_package
    from pipeline.serving.server import Ports, TritonServer

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    repo = run_package(default_model_path(), out / "model_repository", max_batch=max(levels))
    with TritonServer(repo, Ports(free(), free(), free(), "127.0.0.1"), out / "server") as server:
        run_bench_serve(server.http_url, server.grpc_url, levels, requests, out, as_json)


@bench_app.command("model")
def bench_model(
    config: Annotated[
        str, typer.Option(help="configs/models/<name>.yaml (random weights)")
    ] = "diffusiongemma-26b-a4b",
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,4",
    context: Annotated[int, typer.Option(help="cached prompt tokens")] = 512,
    steps: Annotated[int, typer.Option(help="fixed denoising steps per canvas")] = 16,
    repeats: Annotated[int, typer.Option(help="timed repetitions (medians)")] = 10,
    out: Annotated[Path, typer.Option(help="directory for the JSON result")] = Path("runs/bench-model"),
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Full-size configuration with random weights: ms per pass vs the bandwidth floor, diffusion vs AR."""
    from pipeline.bench.model import run_bench_model

    try:
        batches = [int(b) for b in batch.split(",")]
    except ValueError as e:
        raise DgpipeError(f"--batch {batch!r}: expected comma-separated integers like 1,4") from e
    run_bench_model(config, batches, context, steps, repeats, dtype, device, out, as_json)


# ---- quantize -------------------------------------------------------------------------------------
@app.command()
def quantize(
    model: ModelOpt = None,
    precision: Annotated[
        str | None,
        typer.Option("--precision", "-p", help="nvfp4, fp8, int4_awq or bf16 (configs/precisions)"),
    ] = None,
    output: Annotated[Path | None, typer.Option(help="quantized checkpoint dir (written atomically)")] = None,
    calib_data: Annotated[
        Path | None, typer.Option(help='JSONL of {"text": ...}; default: Sudoku puzzles for a Sudoku model')
    ] = None,
    calib_size: Annotated[int, typer.Option(help="calibration prompts")] = 64,
    calib_steps: Annotated[int, typer.Option(help="denoise steps per calibration canvas")] = 8,
    exclude: Annotated[
        list[str] | None, typer.Option(help="keep modules matching this glob unquantized (repeatable)")
    ] = None,
    kv_cache: Annotated[str, typer.Option(help="none or fp8 (K/V scales for the serving engine)")] = "none",
    adapter: Annotated[
        Path | None, typer.Option(help="PEFT LoRA adapter dir merged before quantizing")
    ] = None,
    target: Annotated[
        str | None, typer.Option(help="GPU target (sm89, sm90/hopper, sm100/blackwell, sm120)")
    ] = None,
    estimate: Annotated[
        bool, typer.Option("--estimate", help="memory plan from --config only: no weights, no quantization")
    ] = False,
    config: Annotated[
        str, typer.Option(help="--estimate: CONFIG.json or a configs/models name")
    ] = "diffusiongemma-26b-a4b",
    context: Annotated[
        int, typer.Option(help="--estimate: tokens of context per sequence")
    ] = EngineLimits.max_context,
    concurrency: Annotated[int, typer.Option(help="--estimate: concurrent sequences")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Quantize with NVIDIA ModelOpt (calibrated on the denoising path) and export in ModelOpt's HF layout."""
    from quantize import commands

    if estimate:
        commands.run_estimate(
            config, [precision] if precision else [], target, context, concurrency, kv_cache, as_json
        )
        return
    from pipeline.runtime.session import default_model_path

    if precision is None or output is None:
        raise DgpipeError(
            "--precision and --output are required", "e.g. --precision nvfp4 --output runs/q/nvfp4"
        )
    commands.run_quantize(
        model or default_model_path(),
        precision,
        output,
        calib_data,
        calib_size,
        calib_steps,
        exclude or [],
        kv_cache,
        adapter,
        target,
        as_json,
    )


@eval_app.command("quantization")
def eval_quantization(
    model: ModelOpt = None,
    precisions: Annotated[str, typer.Option(help="comma-separated; bf16 is always the reference")] = (
        "nvfp4,fp8,int4_awq"
    ),
    n: Annotated[int, typer.Option(help="held-out puzzles per precision")] = 200,
    seed: Annotated[int, typer.Option(help="puzzle-set seed")] = 20_000,
    calib_size: Annotated[int, typer.Option(help="calibration prompts")] = 64,
    max_drop: Annotated[
        float, typer.Option(help="fail if a solve rate is more than this many points below bf16")
    ] = 2.0,
    out: Annotated[Path, typer.Option(help="where the quantized checkpoints go")] = Path("runs/quantized"),
    as_json: JsonOpt = False,
) -> None:
    """Quantize to each precision and report solve rate, steps/canvas, KL vs bf16 and bytes; gate on accuracy."""
    from pipeline.runtime.session import default_model_path
    from quantize import commands

    if n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {n})")
    names = [p.strip() for p in precisions.split(",") if p.strip()]
    commands.run_report(model or default_model_path(), names, out, n, seed, calib_size, max_drop, as_json)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except DgpipeError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
