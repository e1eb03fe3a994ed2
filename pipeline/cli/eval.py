"""`dgpipe eval sudoku` (held-out accuracy) and `dgpipe eval quantization` (each precision against bf16)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app(help="Accuracy evaluations.", no_args_is_help=True)


@app.command("sudoku")
def eval_sudoku_cmd(
    model: opt.Model = None,
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
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    onnx: Annotated[
        Path | None, typer.Option(help="run the exported ONNX dir in onnxruntime (CPU) instead of PyTorch")
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Solve rate, constraint-valid rate, steps per canvas and tokens/s on held-out puzzles."""
    if decode not in ("diffusion", "ar"):
        raise DgpipeError(f"--decode {decode!r}: choose diffusion or ar")
    if n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {n})")
    lohi = opt.givens_range(givens) if givens else None
    overrides = {
        "max_denoising_steps": steps,
        "entropy_bound": entropy_bound,
        "confidence_threshold": confidence_threshold,
    }
    from pipeline.demo import sudoku
    from pipeline.demo.evaluate import eval_sudoku
    from pipeline.demo.prompt_format import SudokuFormat
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device)
    runner = session.model
    if onnx is not None:  # same runtime and sampler state, network + sampler step in onnxruntime
        from pipeline.onnx.backend import OnnxRuntimeBackend

        if decode != "diffusion":
            raise DgpipeError("--onnx runs diffusion decoding only", "drop --decode ar")
        runner = OnnxRuntimeBackend(onnx, session.checkpoint.path)
    if not isinstance(session.prompt_format, SudokuFormat):
        raise DgpipeError(
            f"{session.checkpoint.path} is not a Sudoku model (dgpipe.json prompt format is not 'sudoku')"
        )
    if lohi is None:
        lohi = tuple(session.checkpoint.dgpipe.get("givens_range", (45, 61)))
    puzzles = sudoku.make_dataset(seed, n, lohi)
    sampler = session.sampler(**overrides)
    with out.progress(f"{decode} on {n} puzzles", total=n, disable=as_json) as advance:
        rep = eval_sudoku(
            runner,  # type: ignore[arg-type]
            puzzles,
            lohi,
            sampler,
            decode=decode,
            infill=not no_infill,
            batch=batch,
            progress=advance,
        )
    result = rep.as_dict() | {"model": str(session.checkpoint.path), "sampler": sampler.model_dump()}
    if onnx is not None:
        result["onnx"] = str(onnx)
    out.show(
        result,
        as_json,
        lambda _: (
            f"{rep.decode}{' +infill' if rep.infill else ''} on {rep.n} puzzles, givens {lohi[0]}-{lohi[1]}: "
            f"solved {rep.solve_rate:.1%}, constraint-valid {rep.valid_rate:.1%}, "
            f"steps/canvas mean {rep.mean_steps:.1f} p90 {rep.p90_steps:.0f}, {rep.tokens_per_s:.0f} tokens/s"
        ),
    )


@app.command("quantization")
def eval_quantization(
    model: opt.Model = None,
    precisions: Annotated[str, typer.Option(help="comma-separated; bf16 is always the reference")] = (
        "nvfp4,fp8,int4_awq"
    ),
    n: Annotated[int, typer.Option(help="held-out puzzles per precision")] = 200,
    seed: Annotated[int, typer.Option(help="puzzle-set seed")] = 20_000,
    calib_size: Annotated[int, typer.Option(help="calibration prompts")] = 64,
    max_drop: Annotated[
        float, typer.Option(help="fail if a solve rate is more than this many points below bf16")
    ] = 2.0,
    out_dir: Annotated[
        Path | None, opt.out("where the quantized checkpoints go; " + opt.in_cache("quantized"))
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Quantize to each precision and report solve rate, steps/canvas, KL vs bf16 and bytes; gate on accuracy."""
    if n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {n})")
    names = [p.strip() for p in precisions.split(",") if p.strip()]
    out_dir = out_dir or opt.cache_dir() / "quantized"
    from pipeline.runtime.session import default_model_path
    from quantize import report

    model = model or default_model_path()
    with out.progress_bars(disable=as_json) as bars:

        def factory(label: str, total: int):
            task = bars.add_task(label, total=total)
            return lambda k: bars.advance(task, k)

        rows = report.build_report(
            model,
            names,
            out_dir,
            n,
            seed,
            calib_size,
            max_drop,
            log=(lambda s: None) if as_json else bars.console.log,
            progress_factory=factory,
        )
    if as_json:
        out.json_out(
            {"model": str(model), "n": n, "seed": seed, "max_drop": max_drop, "rows": report.as_dicts(rows)}
        )
    else:
        out.line(report.table(rows))
    out.saved([out_dir], as_json, "quantized checkpoints")
    report.gate(rows, max_drop)
