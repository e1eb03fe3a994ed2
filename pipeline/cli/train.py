"""`dgpipe train`: train the embedded Sudoku model; one JSON line per evaluation on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli import options as opt
from pipeline.cli import output as out
from pipeline.demo.sudoku import DEFAULT_GIVENS
from pipeline.errors import DgpipeError

app = opt.typer_app()
DEFAULT_BAND = "-".join(map(str, DEFAULT_GIVENS))  # the demo's band, as --givens spells it


OutDir = Annotated[Path | None, opt.out("output checkpoint dir (HF layout)", "sudoku-tiny")]
MaxSteps = Annotated[int | None, typer.Option(help="step budget (whichever of minutes/steps ends first)")]
CurriculumStart = Annotated[
    int | None, typer.Option(help="lowest givens at the start (default 62; a warm start may begin lower)")
]
EvalGivens = Annotated[
    str,
    typer.Option(
        help="held-out bands, comma-separated (first = the primary band recorded as the checkpoint's "
        "range); the checkpoint kept is the best by the sum of their solve rates. Default: --givens"
    ),
]
HardFraction = Annotated[
    float, typer.Option(help="share of each batch drawn in proportion to each puzzle's last loss")
]
PinProb = Annotated[
    float, typer.Option(help="share of examples whose givens stay clean in the canvas (infill decoding)")
]


@app.command()
def train(
    out_dir: OutDir = None,
    minutes: Annotated[float, typer.Option(help="wall-clock training budget")] = 118.0,
    max_steps: MaxSteps = None,
    config: Annotated[str, typer.Option(help="configs/models/<name>.yaml")] = "sudoku-tiny",
    givens: Annotated[str, typer.Option(help="final givens range LO-HI of the curriculum")] = DEFAULT_BAND,
    curriculum_start: CurriculumStart = None,
    eval_givens: EvalGivens = "",
    hard_fraction: HardFraction = 0.0,
    pin_prob: PinProb = 0.0,
    pool_size: Annotated[int, typer.Option(help="base puzzles generated (augmented on the fly)")] = 4096,
    warmup_steps: Annotated[int, typer.Option(help="learning-rate warm-up steps")] = 200,
    eval_n: Annotated[int, typer.Option(help="held-out puzzles per band and evaluation")] = 128,
    threads: Annotated[int, typer.Option(help="torch CPU threads")] = 2,
    batch_size: Annotated[int, typer.Option(help="examples per step")] = 64,
    lr: Annotated[float, typer.Option(help="peak learning rate")] = 2e-3,
    seed: Annotated[int, typer.Option(help="init, data and noise seed")] = 0,
    resume: Annotated[Path | None, typer.Option(help="continue from this checkpoint's weights")] = None,
    eval_every: Annotated[float, typer.Option(help="minutes between held-out evaluations")] = 15.0,
) -> None:
    """Train the embedded Sudoku DiffusionGemma (diffusion + causal-LM objectives, curriculum, symmetries)."""
    lo, hi = opt.givens_range(givens)
    bands = [opt.givens_range(b) for b in eval_givens.split(",")] if eval_givens else [(lo, hi)]
    for flag, share in (("--hard-fraction", hard_fraction), ("--pin-prob", pin_prob)):
        if not 0.0 <= share <= 1.0:
            raise DgpipeError(f"{flag} {share}: expected a share in 0..1")
    from pipeline.demo.train import TrainConfig
    from pipeline.demo.train import train as run_train
    from pipeline.errors import validation_error

    flags = {"eval_every_minutes": "--eval-every"}  # the options named otherwise than their field
    with validation_error(lambda where, msg: f"{flags.get(where, '--' + where.replace('_', '-'))}: {msg}"):
        cfg = TrainConfig(
            model=config,
            minutes=minutes,
            max_steps=max_steps,
            givens=(lo, hi),
            curriculum_start=curriculum_start if curriculum_start is not None else max(62, lo),
            eval_givens=bands[0],
            extra_eval_givens=bands[1:],
            hard_fraction=hard_fraction,
            pin_prob=pin_prob,
            pool_size=pool_size,
            warmup_steps=warmup_steps,
            eval_n=eval_n,
            threads=threads,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            eval_every_minutes=eval_every,
        )
    path = run_train(cfg, out_dir, resume=resume, log=lambda row: out.line(json.dumps(row)))
    out.saved([path], True, "checkpoint")
