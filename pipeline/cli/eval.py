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
    n: Annotated[int, typer.Option(help="held-out puzzles per band")] = 200,
    givens: Annotated[
        str,
        typer.Option(
            help="givens bands LO-HI, comma-separated (e.g. 45-61,36-44,25-35); default: the model's range"
        ),
    ] = "",
    arms: Annotated[
        str,
        typer.Option(
            help="compare decodings on the same puzzles and seeds, comma-separated: pinned (diffusion, "
            "givens pinned: the default), unpinned (diffusion, the model copies the givens), ar "
            "(left-to-right); adds Wilson intervals and paired McNemar tests. Replaces --decode/--no-infill"
        ),
    ] = "",
    decode: Annotated[
        str, typer.Option(help="diffusion or ar (left-to-right with the KV cache)")
    ] = "diffusion",
    no_infill: Annotated[
        bool, typer.Option("--no-infill", help="do not pin the givens in the canvas")
    ] = False,
    steps: Annotated[int | None, typer.Option(help="max denoising steps")] = None,
    entropy_bound: Annotated[float | None, typer.Option(help="EB-sampler bound")] = None,
    confidence_threshold: Annotated[float | None, typer.Option(help="0 = fixed steps")] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            help="another checkpoint (e.g. the previous weights) as one more arm, 'baseline': pinned "
            "decoding with the same sampler settings and seeds, paired tests against every arm"
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="puzzle-set seed")] = 20_000,
    batch: Annotated[int, typer.Option(help="puzzles per batch")] = 50,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    onnx: Annotated[
        Path | None, typer.Option(help="run the exported ONNX dir in onnxruntime (CPU) instead of PyTorch")
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Solve rate (95% Wilson interval), constraint-valid rate, steps per canvas and tokens/s on held-out
    Sudoku puzzles, per givens band; with --arms, several decodings side by side with paired tests."""
    if decode not in ("diffusion", "ar"):
        raise DgpipeError(f"--decode {decode!r}: choose diffusion or ar")
    if n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {n})")
    bands = [opt.givens_range(b) for b in givens.split(",")] if givens else []
    from pipeline.demo import evaluate

    if arms:
        if decode != "diffusion" or no_infill:
            raise DgpipeError("--arms replaces --decode and --no-infill", "drop one of them")
        arm_list = [a.strip() for a in arms.split(",")]
        bad = [a for a in arm_list if a not in evaluate.ARMS]
        if bad or len(set(arm_list)) != len(arm_list):
            raise DgpipeError(f"--arms {arms!r}: choose distinct arms from {', '.join(evaluate.ARMS)}")
    else:
        arm_list = [next(k for k, v in evaluate.ARMS.items() if v == (decode, not no_infill))]
    overrides = {
        "max_denoising_steps": steps,
        "entropy_bound": entropy_bound,
        "confidence_threshold": confidence_threshold,
    }
    from pipeline.demo.prompt_format import SudokuFormat
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device)
    runner = session.model
    if onnx is not None:  # same runtime and sampler state, network + sampler step in onnxruntime
        from pipeline.onnx.backend import OnnxRuntimeBackend

        if decode != "diffusion" or "ar" in arm_list:
            raise DgpipeError("--onnx runs diffusion decoding only", "drop --decode ar / the ar arm")
        runner = OnnxRuntimeBackend(onnx, session.checkpoint.path)
    if not isinstance(session.prompt_format, SudokuFormat):
        raise DgpipeError(
            f"{session.checkpoint.path} is not a Sudoku model (dgpipe.json prompt format is not 'sudoku')"
        )
    if not bands:
        bands = [tuple(session.checkpoint.dgpipe.get("givens_range", (45, 61)))]
    sampler = session.sampler(**overrides)
    base_model = None
    if baseline is not None:
        if onnx is not None:
            raise DgpipeError("--baseline compares PyTorch checkpoints", "drop --onnx or --baseline")
        base = load_session(baseline, dtype, device)
        if not isinstance(base.prompt_format, SudokuFormat):
            raise DgpipeError(f"--baseline {baseline} is not a Sudoku model")
        base_model = base.model
    total = n * len(bands) * (len(arm_list) + (base_model is not None))
    with out.progress(
        f"{', '.join(arm_list)} on {n} puzzles x {len(bands)} bands", total=total, disable=as_json
    ) as advance:
        results = evaluate.compare_arms(
            runner,  # type: ignore[arg-type]
            bands,
            arm_list,
            n,
            seed,
            sampler,
            batch=batch,
            progress=advance,
            baseline=base_model,
        )
    first = next(iter(results[0].arms.values()))
    result = (
        first.as_dict()  # the first band's first arm, flat: what scripts reading one figure use
        | {
            "model": str(session.checkpoint.path),
            "task": "Sudoku solver",
            "seed": seed,
            "sampler": sampler.model_dump(),
            "baseline": str(baseline) if baseline is not None else None,
            "bands": [b.as_dict() for b in results],
        }
    )
    if onnx is not None:
        result["onnx"] = str(onnx)
    out.show(result, as_json, lambda _: _sudoku_table(str(session.checkpoint.path), results, n))


def _sudoku_table(model: str, results, n: int) -> list[str]:
    """One row per band and arm, then the paired tests: the BENCHMARKS.md table's shape."""
    lines = [
        f"Sudoku solver {model}: {n} held-out puzzles per band (same puzzles and seeds for every arm)",
        f"{'givens':<8} {'arm':<12} {'solved':>7} {'95% CI':>15} {'valid':>7} {'steps/canvas':>13} "
        f"{'p90':>4} {'tokens/s':>9}",
    ]
    for band in results:
        lo, hi = band.givens
        for arm, r in band.arms.items():
            ci_lo, ci_hi = r.solve_ci95
            lines.append(
                f"{lo}-{hi:<5} {arm:<12} {r.solve_rate:>7.1%} {f'{ci_lo:.1%}-{ci_hi:.1%}':>15} "
                f"{r.valid_rate:>7.1%} {r.mean_steps:>13.1f} {r.p90_steps:>4.0f} {r.tokens_per_s:>9.0f}"
            )
        for t in band.tests:
            lines.append(
                f"{lo}-{hi:<5} McNemar {t.a} vs {t.b}: solved only by {t.a} {t.only_a}, only by {t.b} "
                f"{t.only_b}, exact p = {t.p_value:.3g}"
            )
    return lines


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
