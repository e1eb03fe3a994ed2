"""Training uses the inference model code: the objective learns, and the output is a loadable checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.demo import sudoku
from pipeline.demo import tokenizer as stok
from pipeline.demo.evaluate import eval_sudoku
from pipeline.demo.train import PuzzlePool, TrainConfig, build_model, curriculum_lo, diffusion_loss, train
from pipeline.model.checkpoint import load_model


@pytest.mark.slow  # 20 optimizer steps of the embedded model: ~30 s
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


@pytest.fixture
def torch_threads():
    """train() sets torch's thread count for the whole process: give the next test the count it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.slow  # trains, then re-evaluates the checkpoint: ~15 s
def test_train_writes_a_checkpoint(tmp_path, torch_threads, monkeypatch):
    # one thread: the default two OpenMP threads on a shared 2-core machine wait on each other at every op
    # of this small model (8 minutes for these 3 steps and 2 evaluations under load, 15 s with one)
    from pipeline.demo import train as training

    cfg = TrainConfig(
        minutes=10, max_steps=3, batch_size=4, pool_size=8, eval_n=4, eval_every_minutes=100, threads=1
    )
    evaluated = []  # the weights each evaluation saw
    evaluate = training.eval_sudoku
    monkeypatch.setattr(training, "eval_sudoku", lambda m, *a, **k: evaluated.append(
        {n: t.detach().clone() for n, t in m.state_dict().items()}) or evaluate(m, *a, **k))  # fmt: skip
    rows = []
    out = train(cfg, tmp_path / "ckpt", log=rows.append)
    model, ckpt = load_model(out)
    saved = model.state_dict()  # what the last logged evaluation measured is what was saved
    assert evaluated and evaluated[-1].keys() == saved.keys()
    assert all(torch.equal(evaluated[-1][n].to(t.dtype), t) for n, t in saved.items())
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


def test_pool_gates_by_curriculum_and_weights_hard_puzzles():
    cfg = TrainConfig(givens=(30, 40), curriculum_start=40, max_givens=45, pool_size=64, hard_fraction=1.0)
    pool = PuzzlePool(cfg)
    pool.refresh(40)
    assert pool.givens.min() >= 30 and pool.givens.max() <= 45
    assert (pool.givens[pool.draw(200)] >= 40).all()  # the curriculum gate
    pool.refresh(30)
    eligible = pool.eligible()
    assert len(eligible) == 64
    # unseen puzzles count as the hardest; once every loss is known, draws follow the losses
    pool.record(eligible, np.full(64, 1e-9))
    pool.record(eligible[:1], np.full(1, 1.0))  # averaged with the previous loss: 0.5
    assert pool.loss[eligible[0]] == pytest.approx(0.5)
    assert (pool.draw(100) == eligible[0]).mean() > 0.95


def test_pinned_givens_stay_clean_in_the_corrupted_canvas(monkeypatch):
    """pin_prob=1: every given cell of the canvas the graded pass sees is the clean digit (as infill
    decoding pins it); pin_prob=0: givens are corrupted like every other cell."""
    cfg = TrainConfig(pool_size=8, batch_size=8, sc_prob=0.0, t_eps=0.99)  # t ~ 1: almost all noise
    model = build_model("sudoku-tiny", seed=0)
    pool = PuzzlePool(cfg)
    pool.refresh(55)
    prompt, target = pool.batch(8)
    given = prompt[:, 2:83] != stok.DOT_ID
    seen = []
    monkeypatch.setattr(model, "denoise", lambda noisy, *a: seen.append(noisy) or torch.zeros(8, 82, 24))
    for pin in (1.0, 0.0):
        diffusion_loss(model, prompt, target, cfg.model_copy(update={"pin_prob": pin}), torch.Generator())
    pinned, free = seen
    assert torch.equal(pinned[:, :81][given], target[:, :81][given])
    assert (free[:, :81][given] == target[:, :81][given]).float().mean() < 0.3  # ~1/24 by chance


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--minutes", "-1"], "--minutes: Input should be greater than 0"),
        (["--minutes", "0"], "--minutes: Input should be greater than 0"),
        (["--batch-size", "0"], "--batch-size: Input should be greater than or equal to 1"),
        (["--threads", "0"], "--threads: Input should be greater than or equal to 1"),
        (["--eval-every", "0"], "--eval-every: Input should be greater than 0"),
    ],
)
def test_budgets_and_sizes_out_of_range_are_refused_naming_the_option(tmp_path, args, needle):
    """`--minutes -1` trained forever (the schedule's fraction never reached 1), 0 divided by zero, a zero
    batch, thread count or evaluation interval failed deep inside: each is refused up front."""
    from tests._utils.cli import dgpipe

    proc = dgpipe("train", *args, "--out", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
