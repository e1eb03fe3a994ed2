"""`dgpipe quantize`: a ModelOpt-quantized checkpoint (calibrated on the denoising path), or --estimate a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.builddir import LAYOUT
from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.cli.build import LOG_NAME  # a build dir's third-party output, the quantize stage's too
from pipeline.cli.capture import capture
from pipeline.errors import DgpipeError
from pipeline.model.config import FLAGSHIP_CONFIG

app = opt.typer_app()


Precision = Annotated[str | None, opt.precision()]
Output = Annotated[Path | None, opt.output("quantized checkpoint dir (written atomically)")]
BuildDir = Annotated[
    Path | None, opt.build_dir("write BUILD_DIR/checkpoint and record the stage (instead of --output)")
]
CalibData = Annotated[
    Path | None, typer.Option(help='JSONL of {"text": ...}; default: Sudoku puzzles for a Sudoku model')
]
Exclude = Annotated[
    list[str] | None, typer.Option(help="keep modules matching this glob unquantized (repeatable)")
]
KvCache = Annotated[str, typer.Option(help="none or fp8 (K/V scales for the serving engine)")]
Target = Annotated[str | None, typer.Option(help="GPU target (sm89, sm90/hopper, sm100/blackwell, sm120)")]
Estimate = Annotated[
    bool, typer.Option("--estimate", help="memory plan from --config only: no weights, no quantization")
]
Config = Annotated[str, typer.Option(help="--estimate: CONFIG.json or a configs/models name")]


@app.command()
def quantize(
    model: opt.Model = None,
    precision: Precision = None,
    output: Output = None,
    build_dir: BuildDir = None,
    calib_data: CalibData = None,
    calib_size: opt.CalibSize = opt.CALIB_SIZE,
    calib_steps: Annotated[int, typer.Option(help="denoise steps per calibration canvas")] = 8,
    exclude: Exclude = None,
    kv_cache: KvCache = "none",
    adapter: opt.Adapter = None,
    target: Target = None,
    estimate: Estimate = False,
    config: Config = FLAGSHIP_CONFIG,
    context: Annotated[
        int, typer.Option(help="--estimate: tokens of context per sequence")
    ] = opt.LIMITS.max_context,
    concurrency: Annotated[int, typer.Option(help="--estimate: concurrent sequences")] = 1,
    as_json: opt.Json = False,
) -> None:
    """Quantize with NVIDIA ModelOpt (calibrated on the denoising path) and export in ModelOpt's HF layout."""
    if estimate:
        from quantize.estimate import estimate as plan

        result = plan(config, [precision] if precision else [], target, context, concurrency, kv_cache)
        out.show(result, as_json, lambda r: _render_estimate(r, target, context, concurrency, kv_cache))
        return
    if output is not None and build_dir is not None:
        raise DgpipeError("--output and --build-dir exclude each other", "pass one of them")
    if precision is None or (output is None and build_dir is None):
        raise DgpipeError(
            "--precision and one of --output / --build-dir are required",
            "e.g. --precision nvfp4 --output ckpt-nvfp4",
        )
    from pipeline.runtime.session import default_model_path
    from quantize.run import QuantizeOptions, check_options

    opts = QuantizeOptions(
        model=opt.model_dir(model, adapter) or default_model_path(),
        precision=precision,
        output=output or build_dir / LAYOUT["checkpoint"],  # with --build-dir: where the stage writes
        calib_data=calib_data,
        calib_size=calib_size,
        calib_steps=calib_steps,
        exclude=exclude or [],
        kv_cache=kv_cache,
        target=target,
    )
    check_options(opts)  # a bad option is one line, before any progress bar or log
    _quantize_logged(opts, build_dir, as_json)


def _quantize_logged(opts, build_dir: Path | None, as_json: bool) -> None:
    """Quantize with ModelOpt's and transformers' output in a log beside the checkpoint (the build dir's
    build.log), the calibration's progress on the console, and the stage's summary."""
    from quantize.run import quantize_checkpoint
    from quantize.stage import quantize_stage, stage_result

    label = f"calibrate {opts.precision} (prefill + {opts.calib_steps} denoise steps)"
    log = build_dir / LOG_NAME if build_dir is not None else opts.output.parent / f"{opts.output.name}.log"
    with capture(log) as cap, out.progress(label, total=None, disable=as_json, console=cap.stderr) as advance:
        if build_dir is not None:
            res = quantize_stage(opts, build_dir, progress=advance)
        else:
            res = stage_result(quantize_checkpoint(opts, progress=advance))
    out.stage(res, as_json)
    if cap.lines:
        out.line(f"{cap.lines} lines of third-party output in {cap.log}", err=True)


def _render_estimate(r: dict, target: str | None, context: int, concurrency: int, kv_cache: str) -> list[str]:
    from quantize.planner import GIB as gib

    rows = [f"exported weights ({r['config']}):"]
    for w in r["weights"]:
        rows.append(
            f"  {w['precision']:<9} {w['bytes'] / gib:7.2f} GiB  ({w['bytes'] / 1e9:.2f} GB; "
            f"{w['quantized_params'] / 1e9:.2f}B quantized + {w['high_precision_params'] / 1e9:.2f}B bf16 params)"
        )
    if r["serving"]:
        rows.append(
            f"serving on {target} (context {context}, concurrency {concurrency}, KV cache {kv_cache}; the workspace "
            "holds a step's working set twice, as under CUDA graphs, and the prefix cache is the server's default):"
        )
        for s in r["serving"]:
            fits = out.flag("fits", True) if s["fits"] else out.flag("does not fit", False)
            rows.append(
                f"  {s['precision']:<9} {s['gpu']:<18} weights {s['weights_gib']:.2f} + KV {s['kv_cache_gib']:.2f} + "
                f"workspace {s['workspace_gib']:.2f} + prefix cache {s['prefix_cache_gib']:.2f} = {s['total_gib']:.2f} GiB "
                f"of {s['gpu_memory_gib']:.0f} GiB: {fits}"
            )
    return rows
