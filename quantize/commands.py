"""Bodies of `dgpipe quantize` and `dgpipe eval quantization` (pipeline/cli.py keeps thin wrappers)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from pipeline.errors import DgpipeError


def _echo_json(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def load_config(config: str):
    """CONFIG.json (HF layout) or a configs/models/<name>.yaml name."""
    from pipeline.model.config import ModelConfig
    from pipeline.resources import load_yaml

    p = Path(config)
    if p.suffix == ".json" or p.is_dir():
        return ModelConfig.from_json_file(p / "config.json" if p.is_dir() else p)
    return ModelConfig.from_dict(load_yaml("models", config), source=config)


def run_estimate(
    config: str,
    precisions: list[str],
    target: str | None,
    context: int,
    concurrency: int,
    kv_cache: str,
    as_json: bool,
) -> None:
    """Exported bytes per precision and serving memory per GPU, from the config alone (meta tensors)."""
    from pipeline.targets import all_precisions, check_precision_on_target, precision
    from pipeline.targets import target as get_target
    from quantize.planner import GIB, as_dict, serving_plan, weight_plan

    if context < 1 or concurrency < 1:
        raise DgpipeError("--context and --concurrency must be >= 1")
    cfg = load_config(config)
    names = precisions or all_precisions()
    weights = [
        as_dict(weight_plan(cfg, precision(p))) | {"gib": round(weight_plan(cfg, precision(p)).gib, 2)}
        for p in names
    ]
    serving = []
    if target:
        t = get_target(target)
        for p in names:
            if p not in t.precisions:
                if precisions:  # asked for explicitly: refuse with the rule's message
                    check_precision_on_target(p, target)
                continue
            serving += [
                as_dict(s) for s in serving_plan(cfg, precision(p), t, context, concurrency, kv_cache)
            ]
    if as_json:
        _echo_json({"config": config, "weights": weights, "serving": serving})
        return
    typer.echo(f"exported weights ({config}):")
    for w in weights:
        typer.echo(
            f"  {w['precision']:<9} {w['bytes'] / GIB:7.2f} GiB  ({w['bytes'] / 1e9:.2f} GB; "
            f"{w['quantized_params'] / 1e9:.2f}B quantized + {w['high_precision_params'] / 1e9:.2f}B bf16 params)"
        )
    if serving:
        typer.echo(
            f"serving on {target} (context {context}, concurrency {concurrency}, KV cache {kv_cache}):"
        )
        for s in serving:
            fits = typer.style("fits", fg="green") if s["fits"] else typer.style("does not fit", fg="red")
            typer.echo(
                f"  {s['precision']:<9} {s['gpu']:<18} weights {s['weights_gib']:.2f} + KV {s['kv_cache_gib']:.2f} + "
                f"workspace {s['workspace_gib']:.2f} = {s['total_gib']:.2f} GiB of {s['gpu_memory_gib']:.0f} GiB: {fits}"
            )


def run_quantize(
    model: Path,
    precision_name: str,
    output: Path,
    calib_data: Path | None,
    calib_size: int,
    calib_steps: int,
    exclude: list[str],
    kv_cache: str,
    adapter: Path | None,
    target: str | None,
    as_json: bool,
) -> None:
    from rich.progress import Progress

    from quantize.run import QuantizeOptions, quantize_checkpoint

    opts = QuantizeOptions(
        model=model,
        precision=precision_name,
        output=output,
        calib_data=calib_data,
        calib_size=calib_size,
        calib_steps=calib_steps,
        exclude=exclude,
        kv_cache=kv_cache,
        adapter=adapter,
        target=target,
    )
    with Progress(transient=True, disable=as_json) as bar:
        task = bar.add_task(f"calibrate {precision_name} (prefill + {calib_steps} denoise steps)", total=None)
        res = quantize_checkpoint(opts, progress=lambda k: bar.advance(task, k))
    if as_json:
        _echo_json(res.as_dict())
        return
    block = f", block {res.block_size}" if res.block_size else ""
    calib = (
        f", calibrated on {res.calib_prompts} prompts x {res.calib_steps} denoise steps"
        if res.calib_prompts
        else ""
    )
    typer.echo(f"{res.precision}{block}: {res.output} ({res.bytes:,} bytes{calib}, {res.seconds:.0f}s)")


def run_report(
    model: Path,
    precisions: list[str],
    out_dir: Path,
    n: int,
    seed: int,
    calib_size: int,
    max_drop: float,
    as_json: bool,
) -> None:
    from rich.progress import Progress

    from quantize import report

    with Progress(transient=True, disable=as_json) as bar:

        def factory(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda k: bar.advance(task, k)

        rows = report.build_report(
            model,
            precisions,
            out_dir,
            n,
            seed,
            calib_size,
            max_drop,
            log=(lambda s: None) if as_json else bar.console.log,
            progress_factory=factory,
        )
    if as_json:
        _echo_json(
            {"model": str(model), "n": n, "seed": seed, "max_drop": max_drop, "rows": report.as_dicts(rows)}
        )
    else:
        typer.echo(report.table(rows))
    report.gate(rows, max_drop)
