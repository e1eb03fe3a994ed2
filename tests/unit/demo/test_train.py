"""Training uses the inference model code: the objective learns, and the output is a loadable checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.demo import sudoku
from pipeline.demo.evaluate import eval_sudoku
from pipeline.demo.train import PuzzlePool, TrainConfig, build_model, curriculum_lo, diffusion_loss, train
from pipeline.model.checkpoint import load_model


@pytest.mark.slow  # a few hundred optimizer steps
def test_objective_learns_a_fixed_batch():
    cfg = TrainConfig(pool_size=8, batch_size=8, sc_prob=0.5)
    torch.manual_seed(0)
    model = build_model("sudoku-tiny", seed=0)
    pool = PuzzlePool(cfg)
    pool.refresh(60)
    prompt, target = pool.batch(8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        gen = torch.Generator().manual_seed(step % 3)  # a few fixed corruptions of the same batch
        diff, ar = diffusion_loss(model, prompt, target, cfg, gen)
        opt.zero_grad()
        (diff + ar).backward()
        opt.step()
        losses.append((diff.item(), ar.item()))
    assert losses[-1][0] < 0.65 * losses[0][0] and losses[-1][1] < 0.65 * losses[0][1], losses


def test_curriculum_moves_from_easy_to_target():
    cfg = TrainConfig(givens=(45, 61), curriculum_start=62, curriculum_fraction=0.5)
    assert (
        curriculum_lo(0.0, cfg) == 62
        and curriculum_lo(0.25, cfg) in (53, 54)
        and curriculum_lo(0.9, cfg) == 45
    )


@pytest.mark.slow  # trains, then re-evaluates the checkpoint
def test_train_writes_a_checkpoint(tmp_path):
    cfg = TrainConfig(minutes=10, max_steps=3, batch_size=4, pool_size=8, eval_n=4, eval_every_minutes=100)
    rows = []
    out = train(cfg, tmp_path / "ckpt", log=rows.append)
    model, ckpt = load_model(out)
    assert ckpt.dgpipe["task"] == "sudoku" and (out / "tokenizer.json").is_file()
    assert ckpt.generation_config["max_denoising_steps"] == 48
    assert rows[-1]["step"] == 3 and rows[-1]["examples"] == 3 * 4
    # the logged metrics describe the saved weights: re-evaluating the checkpoint on the same held-out
    # puzzles (train's seed 10_000 + cfg.seed) gives the same numbers
    rep = eval_sudoku(model, sudoku.make_dataset(10_000 + cfg.seed, 4, cfg.eval_givens), cfg.eval_givens)
    assert rep.n == 4
    assert (rows[-1]["solve_rate"], rows[-1]["valid_rate"], rows[-1]["mean_steps"]) == (
        rep.solve_rate,
        rep.valid_rate,
        rep.mean_steps,
    )
    assert json.loads((tmp_path / "ckpt.curve.jsonl").read_text().splitlines()[-1])["step"] == 3
    assert model.num_parameters() > 1_000_000
