"""`dgpipe bench local|sweep|serve|requests|model|pass|guided|schemas|flops|export-memory|load-memory|gpu|
gpu-trace|moe-tiles|prefix`: parse the options, run a benchmark of pipeline/bench/, print the table its module
renders (`render`), say where the JSON and PNG went."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from pipeline.atomic import atomic_write_text
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError
from pipeline.model.config import FLAGSHIP_CONFIG

app = opt.typer_app(help="Benchmarks (results as JSON, a table and PNG plots).", no_args_is_help=True)


def _report(result: dict, as_json: bool, render: Callable, *files: Path) -> None:
    """The table (or the JSON with --json) on stdout, the same table written beside the result's JSON (the
    first file, as .txt), and where everything went."""
    out.show(result, as_json, render)
    text = render(result)
    table = files[0].with_suffix(".txt")
    atomic_write_text(table, "\n".join([text] if isinstance(text, str) else text) + "\n")
    out.saved([files[0], table, *files[1:]], as_json)


def _out(name: str, what: str = "directory for JSON and PNG"):
    return opt.out(what, name)


@app.command("local")
def bench_local(
    model: opt.Model = None,
    runs: Annotated[int, typer.Option(min=1, help="repetitions (medians are reported)")] = 5,
    batch: Annotated[int, typer.Option(min=1, help="prompts per run")] = 1,
    reference: Annotated[
        bool, typer.Option(help="also time transformers' generate on the same checkpoint")
    ] = True,
    out_dir: Annotated[Path | None, _out("bench-local", "directory for JSON and PNG results")] = None,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    as_json: opt.Json = False,
) -> None:
    """In-process speed: ms per denoise pass, passes per canvas, tokens/s; diffusion vs AR vs transformers."""
    from pipeline.bench.local import PLOT_FILE, RESULT_FILE, run_bench_local
    from pipeline.bench.local import render as render_local

    result = run_bench_local(model, runs, batch, reference, out_dir, dtype, device)
    _report(result, as_json, render_local, out_dir / RESULT_FILE, out_dir / PLOT_FILE)


@app.command("sweep")
def bench_sweep(
    model: opt.Model = None,
    bounds: Annotated[str, typer.Option(help="comma-separated entropy bounds")] = "0.03,0.1,0.3,1,3",
    steps: Annotated[str, typer.Option(help="comma-separated max denoising steps")] = "2,4,8,16,48",
    n: Annotated[
        int, typer.Option(min=1, help="held-out examples per point (the model's prompt format draws them)")
    ] = 100,
    out_dir: Annotated[Path | None, _out("bench-sweep")] = None,
    as_json: opt.Json = False,
) -> None:
    """Solve rate (the prompt format's judgement) against mean steps per canvas over entropy bound x max
    steps (Pareto curve)."""
    try:
        b = [float(x) for x in bounds.split(",")]
        st = [int(x) for x in steps.split(",")]
    except ValueError as e:
        raise DgpipeError("--bounds and --steps take comma-separated numbers") from e
    if min(b) <= 0 or min(st) < 1:
        raise DgpipeError("need bounds > 0 and steps >= 1")
    from pipeline.bench.sweep import SWEEP_JSON, SWEEP_PLOT, run_sweep
    from pipeline.bench.sweep import render as render_sweep

    with out.progress("sweep", total=len(b) * len(st) * n, disable=as_json) as advance:
        result = run_sweep(model, b, st, n, out_dir, progress=advance)
    _report(result, as_json, render_sweep, out_dir / SWEEP_JSON, out_dir / SWEEP_PLOT)


ServeUrl = Annotated[
    str | None, typer.Option(help="HTTP URL of a running server (default: start one on the embedded model)")
]
GrpcUrl = Annotated[str | None, typer.Option(help="gRPC URL of the same server")]
Concurrency = Annotated[
    str | None, typer.Option(help="comma-separated concurrency levels [default: 1,2,4,8; --openai 1,4,16]")
]
OpenAI = Annotated[
    bool,
    typer.Option(
        "--openai",
        help="with --url http://HOST:PORT/v1: that OpenAI endpoint driven as AIPerf and guidellm drive it "
        "(TTFT, ITL, tokens/s); without: the OpenAI frontend against direct gRPC, latency and CPU per "
        "request (starts its own server)",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(envvar="DGPIPE_API_KEY", show_envvar=True, help="--openai --url: the endpoint's Bearer key"),
]
OutputTokens = Annotated[
    int | None,
    typer.Option(min=1, help="output tokens each request asks for [default: the reference answer's canvas]"),
]
ModelName = Annotated[
    str | None,
    typer.Option("--model-name", help="--openai --url: the model to ask for [default: the listed one]"),
]


@app.command("serve")
def bench_serve(
    url: ServeUrl = None,
    grpc_url: GrpcUrl = None,
    concurrency: Concurrency = None,
    requests: Annotated[int, typer.Option(min=1, help="requests per level and protocol")] = 32,
    openai: OpenAI = False,
    rounds: Annotated[int, typer.Option(min=1, help="--openai: alternating rounds per level (medians)")] = 3,
    api_key: ApiKey = None,
    model_name: ModelName = None,
    output_tokens: OutputTokens = None,
    out_dir: Annotated[Path | None, _out("bench-serve")] = None,
    as_json: opt.Json = False,
) -> None:
    """Triton over HTTP and gRPC at several concurrencies, with the same requests in-process alongside;
    with --openai --url .../v1, that OpenAI endpoint driven as load tools drive it; with --openai alone, the
    OpenAI-compatible frontend against direct gRPC."""
    levels = opt.int_list(concurrency or ("1,4,16" if openai else "1,2,4,8"), "--concurrency")
    if openai and url:
        if not url.rstrip("/").endswith("/v1") or grpc_url:
            raise DgpipeError(
                f"--openai --url {url}: expected the OpenAI endpoint http://HOST:PORT/v1 (and no --grpc-url)"
            )
        from pipeline.bench.openai_load import LOAD_JSON, bench_openai_load
        from pipeline.bench.openai_load import render as render_load

        result = bench_openai_load(url, levels, requests, out_dir, model_name, api_key, output_tokens)
        _report(result, as_json, render_load, out_dir / LOAD_JSON)
        return
    if openai:
        if grpc_url:
            raise DgpipeError(
                "--openai without --url starts its own tritonserver and frontend (it reads their CPU time): "
                "drop --grpc-url"
            )
        from pipeline.bench.openai_overhead import OPENAI_JSON, bench_openai, render

        _report(bench_openai(levels, requests, rounds, out_dir), as_json, render, out_dir / OPENAI_JSON)
        return
    from pipeline.bench.serve import SERVE_JSON, SERVE_PLOTS
    from pipeline.bench.serve import bench_serve as run
    from pipeline.bench.serve import render as render_serve

    result = run(url, grpc_url, levels, requests, out_dir)
    _report(result, as_json, render_serve, out_dir / SERVE_JSON, *(out_dir / p for p in SERVE_PLOTS))


@app.command("requests")
def bench_requests_file(
    path: Annotated[Path, typer.Argument(help="JSONL file to write")],
    requests: Annotated[int, typer.Option(min=1, help="how many")] = 64,
    output_tokens: OutputTokens = None,
) -> None:
    """Write the serving benchmarks' held-out requests as JSONL for load tools: AIPerf `--input-file PATH
    --custom-dataset-type single_turn`, guidellm `--data kind=json_file,path=PATH`."""
    from pipeline.bench.openai_load import held_out_requests, write_requests

    written = write_requests(path, held_out_requests(requests, output_tokens))
    out.line(f"{requests} requests: {written}")


@app.command("model")
def bench_model(
    config: Annotated[
        str, typer.Option(help="configs/models/<name>.yaml (random weights)")
    ] = FLAGSHIP_CONFIG,
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,4",
    context: Annotated[int, typer.Option(min=1, help="cached prompt tokens")] = 512,
    steps: Annotated[int, typer.Option(min=1, help="fixed denoising steps per canvas")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="timed repetitions (medians)")] = 10,
    out_dir: Annotated[Path | None, _out("bench-model", "directory for the JSON result")] = None,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    as_json: opt.Json = False,
) -> None:
    """Full-size configuration with random weights: ms per pass vs the bandwidth floor, diffusion vs AR."""
    batches = opt.int_list(batch, "--batch", " like 1,4")
    from pipeline.bench.model import PLOT_FILE, RESULT_FILE, run_bench_model
    from pipeline.bench.model import render as render_model

    result = run_bench_model(config, batches, context, steps, repeats, dtype, device, out_dir)
    _report(result, as_json, render_model, out_dir / RESULT_FILE, out_dir / PLOT_FILE)


@app.command("guided")
def bench_guided(
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,8",
    runs: Annotated[int, typer.Option(min=1, help="timed repetitions of each (medians)")] = 5,
    fixed_steps: Annotated[int, typer.Option(min=1, help="steps per canvas of the fixed-steps policy")] = 16,
    out_dir: Annotated[Path | None, _out("bench-guided", "directory for the JSON result")] = None,
    as_json: opt.Json = False,
) -> None:
    """Constrained decoding's cost: the embedded model with and without a [1-9]{81} regex, side by side."""
    batches = opt.int_list(batch, "--batch", " like 1,8")
    from pipeline.bench.guided import PLOT_FILE, RESULT_FILE, run_bench_guided
    from pipeline.bench.guided import render as render_guided

    result = run_bench_guided(out_dir, batches, runs, fixed_steps)
    _report(result, as_json, render_guided, out_dir / RESULT_FILE, out_dir / PLOT_FILE)


@app.command("schemas")
def bench_schemas(
    stride: Annotated[int, typer.Option(min=1, help="every N-th schema of the committed sample")] = 1,
    vocab_size: Annotated[
        int, typer.Option(min=260, help="byte-level BPE vocabulary trained on the sample")
    ] = 4096,
    walks: Annotated[int, typer.Option(min=1, help="model-free outputs per compiled schema")] = 2,
    out_dir: Annotated[Path | None, _out("bench-schemas", "directory for the JSON result")] = None,
    as_json: opt.Json = False,
) -> None:
    """The grammar engine on JSONSchemaBench's sets: compiled / refused %, valid outputs, compile p50/p95;
    llguidance and XGrammar with their defaults beside it where they are installed (docs/benchmarks/constrained.md)."""
    from pipeline.bench.guided import SCHEMAS_RESULT_FILE, run_bench_schemas, schemas_table

    result = run_bench_schemas(out_dir, stride, vocab_size, walks)
    _report(result, as_json, schemas_table, out_dir / SCHEMAS_RESULT_FILE)


@app.command("flops")
def bench_flops(
    config: Annotated[
        str, typer.Option(help="configs/models/<name>.yaml, traced without weights")
    ] = FLAGSHIP_CONFIG,
    batch: Annotated[str, typer.Option(help="comma-separated canvases per pass")] = "1,4,8",
    context: Annotated[int, typer.Option(min=0, help="cached tokens the pass attends to")] = 4096,
    routed_onnx: Annotated[
        Path | None, typer.Option(help="count this routed export instead of tracing")
    ] = None,
    dense_onnx: Annotated[
        Path | None, typer.Option(help="count this dense export instead of tracing")
    ] = None,
    out_dir: Annotated[Path | None, _out("bench-flops", "directory for the JSON result")] = None,
    as_json: opt.Json = False,
) -> None:
    """FLOPs and bytes per denoise pass from the exported graph, dense vs routed MoE, vs H100/H200/B200 floors."""
    from pipeline.bench.flops import RESULT_FILE, render, run

    batches = tuple(opt.int_list(batch, "--batch", " like 1,4,8"))
    dirs = {k: v for k, v in (("routed", routed_onnx), ("dense", dense_onnx)) if v is not None}
    result = run(config, batches, context, dirs or None, out_dir)
    _report(result, as_json, render, out_dir / RESULT_FILE)


@app.command("export-memory")
def bench_export_memory(
    config: Annotated[
        str, typer.Option(help="configs/models/<name>.yaml (random bf16 weights)")
    ] = FLAGSHIP_CONFIG,
    layers: Annotated[
        int, typer.Option(min=1, help="decoder layers written at full shapes (disk: ~1.6 GB each)")
    ] = 6,
    work_dir: Annotated[
        Path, typer.Option(help="scratch for the checkpoint and the export (deleted)")
    ] = Path("/tmp/dgpipe-export-memory"),
    moe: Annotated[str, typer.Option(help="routed or dense")] = "routed",
    sparse: Annotated[
        bool,
        typer.Option(
            help="zero weights stored as file holes (~0 bytes on disk): the full 26B depth fits beside its export"
        ),
    ] = False,
    out_dir: Annotated[Path | None, _out("bench-export-memory", "directory for the JSON result")] = None,
    as_json: opt.Json = False,
) -> None:
    """Peak host RSS of the streaming ONNX export on a random checkpoint with the model's real shapes."""
    from pipeline.bench.export_memory import RESULT_FILE, as_dict, run
    from pipeline.bench.export_memory import render as render_export_memory
    from pipeline.onnx.contract import MOE_FORMS

    if moe not in MOE_FORMS:  # before a checkpoint of full-size layers is written
        raise DgpipeError(f"--moe {moe}: unknown MoE form", f"choose one of: {', '.join(MOE_FORMS)}")
    result = as_dict(run(config, layers, work_dir, moe, sparse=sparse, out_dir=out_dir))
    _report(result, as_json, render_export_memory, out_dir / RESULT_FILE)


@app.command("load-memory")
def bench_load_memory(
    config: Annotated[
        str, typer.Option(help="configs/models/<name>.yaml (random weights)")
    ] = FLAGSHIP_CONFIG,
    layers: Annotated[int, typer.Option(min=1, help="decoder layers written at full shapes")] = 2,
    fmt: Annotated[str, typer.Option("--format", help="fp8 or nvfp4 (ModelOpt layout)")] = "fp8",
    work_dir: Annotated[Path, typer.Option(help="scratch for the checkpoint (deleted)")] = Path(
        "/tmp/dgpipe-load-memory"
    ),
    out_dir: Annotated[Path | None, _out("bench-load-memory", "directory for the JSON result")] = None,
    as_json: opt.Json = False,
) -> None:
    """Peak memory of loading a quantized checkpoint: the CPU route and the tensor-core route."""
    from pipeline.bench.load_memory import RESULT_FILE, as_dict, render, run

    result = as_dict(run(config, layers, fmt, work_dir, out_dir=out_dir))
    _report(result, as_json, render, out_dir / RESULT_FILE)


@app.command("pass")
def bench_pass(
    config: Annotated[
        str | None,
        typer.Option(
            help="configs/models/<name>.yaml with random weights (e.g. bench-medium); default: --model"
        ),
    ] = None,
    model: opt.Model = None,
    batch: Annotated[int, typer.Option(min=1, help="canvases per denoise pass")] = 1,
    context: Annotated[int, typer.Option(min=1, help="cached prompt tokens")] = 32,
    steps: Annotated[
        int, typer.Option(min=3, help="fixed denoising steps per canvas, at least 3 (steps 2..N-1 are timed)")
    ] = 4,
    rounds: Annotated[int, typer.Option(min=1, help="interleaved rounds over the systems (medians)")] = 3,
    reference: Annotated[bool, typer.Option(help="time transformers on the same weights")] = True,
    onnx: Annotated[bool, typer.Option(help="export the model and time the ONNX Runtime backend")] = True,
    generate: Annotated[
        bool,
        typer.Option(help="a checkpoint with a prompt format: adaptive generate tokens/s vs transformers"),
    ] = True,
    out_dir: Annotated[Path | None, _out("bench-pass", "directory for the JSON result")] = None,
    compile: opt.Compile = False,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    as_json: opt.Json = False,
) -> None:
    """One denoise step split into network / sampler / host against the matmul floor (FLOPs / measured GEMM
    rate), with transformers and ONNX Runtime on the same weights, interleaved."""
    if config is not None and model is not None:
        raise DgpipeError("pass --config (random weights) or --model (a checkpoint), not both")
    from pipeline.bench.step import PLOT_FILE, RESULT_FILE, run_bench_pass
    from pipeline.bench.step import render as render_pass

    arms = 1 + reference + onnx
    with out.progress("bench pass", total=rounds * arms, disable=as_json) as advance:
        result = run_bench_pass(
            config,
            model,
            batch,
            context,
            steps,
            rounds,
            reference,
            onnx,
            generate,
            dtype,
            device,
            out_dir,
            progress=advance,
            compile=compile,
        )
    _report(result, as_json, render_pass, out_dir / RESULT_FILE, out_dir / PLOT_FILE)


@app.command("gpu")
def bench_gpu(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="list every check and why it would skip here; run nothing")
    ] = False,
    out_dir: Annotated[Path | None, _out("bench-gpu", "directory for gpu.json and gpu.md")] = None,
    as_json: opt.Json = False,
) -> None:
    """Everything only a GPU can show, within 8 minutes: kernel build, GPU tests, 26B pass per format vs
    the HBM floor, largest batch."""
    from pipeline.bench.gpu.checks import RESULT_FILE, TABLE_FILE, run_bench_gpu
    from pipeline.bench.gpu.report import render

    report = None if as_json else lambda c: out.line(f"{c.name}: {c.status} ({c.seconds:.0f} s)", err=True)
    result = run_bench_gpu(out_dir, dry_run, on_check=report)
    out.show(result, as_json, lambda r: [render(r)])
    out.saved([out_dir / RESULT_FILE, out_dir / TABLE_FILE], as_json)


@app.command("moe-tiles")
def bench_moe_tiles(
    operand: Annotated[
        str | None, typer.Option(help="fp8 or bf16 weights (default: fp8 where the GPU has FP8 tensor cores)")
    ] = None,
    config: Annotated[
        str, typer.Option(help="configs/models/<name>.yaml whose expert shapes to tune")
    ] = FLAGSHIP_CONFIG,
    budget_s: Annotated[
        float, typer.Option(help="seconds to spend (the climb from the default tiles stops there)")
    ] = 120.0,
    install: Annotated[
        bool,
        typer.Option(help="also put the table where dgpipe on this host reads it (the cache's moe_tiles/)"),
    ] = True,
    out_dir: Annotated[Path | None, _out("bench-moe-tiles", "directory for the JSON, table and YAML")] = None,
    as_json: opt.Json = False,
) -> None:
    """Tune dgpipe's Triton MoE GEMM for this GPU: time candidate tiles at the model's expert shapes, write
    the fastest per shape and batch as this GPU model's tile table."""
    if operand not in (None, "fp8", "bf16"):
        raise DgpipeError(f"--operand must be fp8 or bf16 (got {operand!r})")
    if budget_s <= 0:
        raise DgpipeError("--budget-s must be > 0")
    from pipeline.bench.gpu.tiles import RESULT_FILE, TABLE_FILE, render, run_moe_tiles
    from pipeline.runtime.kernels.moe_tiles import TABLE_DIR

    install_dir = opt.cache_dir() / TABLE_DIR if install else None
    with out.progress_bars(as_json) as bars:
        task = bars.add_task("bench moe-tiles: candidate tiles", total=None)
        result = run_moe_tiles(out_dir, operand, config, budget_s, install_dir=install_dir,
                               on_tile=lambda i, n: bars.update(task, completed=i, total=n))  # fmt: skip
    out.show(result, as_json, render)
    out.saved([out_dir / RESULT_FILE, out_dir / TABLE_FILE, *map(Path, result["table_files"])], as_json)


@app.command("gpu-trace")
def bench_gpu_trace(
    batch: Annotated[str, typer.Option(help="comma-separated canvases per traced pass")] = "1,16",
    layers: Annotated[
        int | None,
        typer.Option(min=1, help="trace only the first N layer kinds (same shapes; default: all layers)"),
    ] = None,
    out_dir: Annotated[
        Path | None, _out("bench-gpu-trace", "directory for gpu_trace.json and gpu_trace.md")
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Every GPU dispatch row's 26B load and denoise pass on fake CUDA tensors, no GPU needed: GEMMs, weight
    bytes against the byte model, host reads, launches per pass."""
    from pipeline.bench.gpu.trace import RESULT_FILE, TABLE_FILE, render, run

    batches = tuple(opt.int_list(batch, "--batch", " like 1,16"))
    report = (
        None
        if as_json
        else lambda t: out.line(f"{t.format} {t.arch} batch {t.batch}: {t.error or 'ok'}", err=True)
    )
    result = run(out_dir, batches, layers, on_trace=report)
    out.show(result, as_json, lambda r: render(r["traces"]))
    out.saved([out_dir / RESULT_FILE, out_dir / TABLE_FILE], as_json)
    if result["failed"]:
        raise typer.Exit(1)


@app.command("prefix")
def bench_prefix(
    config: Annotated[
        str,
        typer.Option(help="configs/models/<name>.yaml with random weights (fp32, CPU); ignored with --model"),
    ] = "bench-medium",
    model: opt.Model = None,
    system_tokens: Annotated[int, typer.Option(min=1, help="shared system prompt tokens")] = 2000,
    question_tokens: Annotated[int, typer.Option(min=1, help="each request's own question tokens")] = 16,
    requests: Annotated[
        int, typer.Option(min=1, help="timed requests per step count (each on and off)")
    ] = 20,
    steps: Annotated[str, typer.Option(help="fixed denoising steps per canvas, comma-separated")] = "1,4,16",
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads")] = 2,
    out_dir: Annotated[Path | None, _out("bench-prefix")] = None,
    as_json: opt.Json = False,
) -> None:
    """Time to first canvas with prefix caching on and off: a long shared system prompt and short questions,
    interleaved; tokens must be identical."""
    try:
        step_counts = tuple(int(s) for s in steps.split(","))
    except ValueError:
        raise DgpipeError(f"--steps must be comma-separated integers (got {steps!r})") from None
    if min(step_counts) < 1:
        raise DgpipeError(f"--steps must be >= 1 (got {steps!r})")
    from pipeline.bench.prefix import PLOT_FILE, RESULT_FILE, load_bench_model, run_bench_prefix
    from pipeline.bench.prefix import render as render_prefix

    m = load_bench_model(None if model else config, model, threads)
    with out.progress("bench prefix", total=requests * len(step_counts), disable=as_json) as advance:
        result = run_bench_prefix(m, system_tokens, question_tokens, requests, step_counts, out_dir, advance)
    _report(result, as_json, render_prefix, out_dir / RESULT_FILE, out_dir / PLOT_FILE)
