"""`dgpipe eval sudoku` (held-out accuracy) and `dgpipe eval quantization` (each precision against bf16)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.errors import DgpipeError

app = opt.typer_app(help="Accuracy evaluations.", no_args_is_help=True)


Givens = Annotated[
    str,
    typer.Option(
        help="givens bands LO-HI, comma-separated (e.g. 45-61,36-44,25-35); default: the model's range"
    ),
]
Arms = Annotated[
    str,
    typer.Option(
        help="compare decodings on the same puzzles and seeds, comma-separated: pinned (diffusion, "
        "givens pinned: the default), unpinned (diffusion, the model copies the givens), ar "
        "(left-to-right); adds Wilson intervals and paired McNemar tests. Replaces --decode/--no-infill"
    ),
]
Decode = Annotated[str, typer.Option(help="diffusion or ar (left-to-right with the KV cache)")]
NoInfill = Annotated[bool, typer.Option("--no-infill", help="do not pin the givens in the canvas")]
Baseline = Annotated[
    Path | None,
    typer.Option(
        help="another checkpoint (e.g. the previous weights) as one more arm, 'baseline': pinned "
        "decoding with the same sampler settings and seeds, paired tests against every arm"
    ),
]
Onnx = Annotated[
    Path | None, typer.Option(help="run the exported ONNX dir in onnxruntime (CPU) instead of PyTorch")
]


@app.command("sudoku")
def eval_sudoku_cmd(
    model: opt.Model = None,
    n: Annotated[int, typer.Option(help="held-out puzzles per band")] = 200,
    givens: Givens = "",
    arms: Arms = "",
    decode: Decode = "diffusion",
    no_infill: NoInfill = False,
    steps: Annotated[int | None, typer.Option(help="max denoising steps")] = None,
    entropy_bound: Annotated[float | None, typer.Option(help="EB-sampler bound")] = None,
    confidence_threshold: Annotated[float | None, typer.Option(help="0 = fixed steps")] = None,
    baseline: Baseline = None,
    seed: Annotated[int, typer.Option(help="puzzle-set seed")] = 20_000,
    batch: Annotated[int, typer.Option(help="puzzles per batch")] = 50,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    onnx: Onnx = None,
    as_json: opt.Json = False,
) -> None:
    """Solve rate (95% Wilson interval), constraint-valid rate, steps per canvas and tokens/s on held-out
    Sudoku puzzles, per givens band; with --arms, several decodings side by side with paired tests."""
    from pipeline.demo import evaluate

    spec = evaluate.SudokuEval(
        model=model,
        arms=evaluate.select_arms(arms, decode, no_infill),
        n=n,
        bands=[opt.givens_range(b) for b in givens.split(",")] if givens else [],
        sampler={
            "max_denoising_steps": steps,
            "entropy_bound": entropy_bound,
            "confidence_threshold": confidence_threshold,
        },
        seed=seed,
        batch=batch,
        baseline=baseline,
        onnx=onnx,
        dtype=dtype,
        device=device,
    )
    with out.progress_bars(disable=as_json) as bars:
        result = evaluate.run_sudoku_eval(spec, _onnx_runner(onnx), _progress_factory(bars))
    out.show(result.summary, as_json, lambda _: result.table())


def _onnx_runner(onnx: Path | None):
    """--onnx: the network and sampler step in onnxruntime, for the checkpoint's tokenizer and config."""
    if onnx is None:
        return None

    def runner(checkpoint: Path):
        from pipeline.onnx.backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend(onnx, checkpoint)

    return runner


def _progress_factory(bars):
    """A progress callback per (label, total), as a transient bar of `bars`."""

    def factory(label: str, total: int):
        task = bars.add_task(label, total=total)
        return lambda k=1: bars.advance(task, k)

    return factory


@app.command("quantization")
def eval_quantization(
    model: opt.Model = None,
    precisions: Annotated[str, typer.Option(help="comma-separated; bf16 is always the reference")] = (
        "nvfp4,fp8,int4_awq"
    ),
    n: Annotated[int, typer.Option(help="held-out puzzles per precision")] = 200,
    seed: Annotated[int, typer.Option(help="puzzle-set seed")] = 20_000,
    calib_size: opt.CalibSize = opt.CALIB_SIZE,
    max_drop: Annotated[
        float, typer.Option(help="fail if a solve rate is more than this many points below bf16")
    ] = 2.0,
    out_dir: Annotated[Path | None, opt.out("where the quantized checkpoints go", "quantized")] = None,
    as_json: opt.Json = False,
) -> None:
    """Quantize to each precision and report solve rate, steps/canvas, KL vs bf16 and bytes; gate on accuracy."""
    if n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {n})")
    names = [p.strip() for p in precisions.split(",") if p.strip()]
    from pipeline.runtime.session import default_model_path
    from quantize import report

    model = model or default_model_path()
    with out.progress_bars(disable=as_json) as bars:
        rows = report.build_report(
            model,
            names,
            out_dir,
            n,
            seed,
            calib_size,
            max_drop,
            log=(lambda s: None) if as_json else bars.console.log,
            progress_factory=_progress_factory(bars),
        )
    if as_json:
        out.json_out(
            {"model": str(model), "n": n, "seed": seed, "max_drop": max_drop, "rows": report.as_dicts(rows)}
        )
    else:
        out.line(report.table(rows))
    out.saved([out_dir], as_json, "quantized checkpoints")
    report.gate(rows, max_drop)
