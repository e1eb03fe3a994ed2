"""`dgpipe train`: train the embedded Sudoku model; one JSON line per evaluation on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out

app = opt.typer_app()


@app.command()
def train(
    out_dir: Annotated[
        Path | None, opt.out("output checkpoint dir (HF layout); " + opt.in_cache("sudoku-tiny"))
    ] = None,
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
    lo, hi = opt.givens_range(givens)
    out_dir = out_dir or opt.cache_dir() / "sudoku-tiny"
    from pipeline.demo.train import TrainConfig
    from pipeline.demo.train import train as run_train

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
    path = run_train(cfg, out_dir, resume=resume, log=lambda row: out.line(json.dumps(row)))
    out.saved([path], True, "checkpoint")
