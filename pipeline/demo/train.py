"""Train the embedded Sudoku DiffusionGemma with DiffusionGemma's objective, on the inference model code.

Per batch (docs/model.md, "Encoder and decoder modes", "Self-conditioning"):
  * encoder pass, causal, over prompt + clean solution: causal-LM loss on the solution tokens, and the
    prompt's K/V (what prefill would cache) for the decoder;
  * uniform-state corruption: each canvas token is replaced by a uniform random token with prob t,
    t ~ U(eps, 1) per example; for a `pin_prob` share of examples the givens stay clean, as infill
    decoding pins them;
  * two-pass self-conditioning with probability 0.5: a no-grad decoder pass gives softmax probabilities
    that are fed to the graded pass (the others get a zero signal, as on the first inference step);
  * flat cross-entropy over all canvas positions.
Puzzles come from a curriculum (many givens first), can be drawn with difficulty weighting (puzzles the
model still gets wrong are drawn more often) and are augmented by Sudoku symmetries. Training can
warm-start from a checkpoint (`resume`), e.g. to extend the shipped model's curriculum to fewer givens.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from pipeline.atomic import check_replaceable
from pipeline.demo import sudoku
from pipeline.demo import tokenizer as stok
from pipeline.demo.evaluate import eval_sudoku
from pipeline.model.checkpoint import SAVED_CHECKPOINT, load_model, save_checkpoint
from pipeline.model.config import ModelConfig, SamplerConfig
from pipeline.model.network import DiffusionGemma
from pipeline.runtime.kv_cache import KeyMeta, attention_masks


class TrainConfig(BaseModel):
    model: str = "sudoku-tiny"  # configs/models/<name>.yaml
    minutes: float = Field(150.0, gt=0)  # the schedule divides by it: 0 fails, a negative one never ends
    max_steps: int | None = Field(
        None, ge=1
    )  # optional step budget: whichever of minutes / steps comes first
    batch_size: int = Field(64, ge=1)
    lr: float = Field(2e-3, gt=0)
    min_lr_ratio: float = 0.05
    warmup_steps: int = Field(200, ge=1)  # the warm-up divides by it
    weight_decay: float = 0.01
    ar_loss_weight: float = 0.5
    ar_fraction: float = 0.25  # share of each batch that also trains the causal-LM (encoder) mode
    sc_prob: float = 0.5
    # share of examples whose givens stay clean in the corrupted canvas, as infill decoding pins them:
    # otherwise the givens are noised like every cell, and a canvas whose givens are all intact (as at
    # every pinned inference step) reads to the model as "almost no noise anywhere" (BENCHMARKS.md, "Embedded model accuracy")
    pin_prob: float = 0.0
    t_eps: float = 0.02
    givens: tuple[int, int] = sudoku.DEFAULT_GIVENS  # final training range (inclusive)
    curriculum_start: int = 62  # lowest givens at the start; decreases to givens[0]
    curriculum_fraction: float = 0.5  # share of the budget spent moving the lower bound
    max_givens: int = 70
    pool_size: int = Field(
        4096, ge=1
    )  # base puzzles over givens[0]..max_givens, generated once (augmented on the fly)
    # difficulty weighting: this share of each batch is drawn in proportion to each puzzle's last
    # per-example diffusion loss (unseen puzzles count as the pool's highest), the rest uniformly.
    # hard_fraction and pin_prob default to the shipped recipe (off): neither has been validated by a
    # full training run yet (no run has separated their effect: BENCHMARKS.md, "Embedded model accuracy")
    hard_fraction: float = 0.0
    eval_every_minutes: float = Field(10.0, gt=0)
    eval_n: int = Field(128, ge=1)
    eval_givens: tuple[int, int] = sudoku.DEFAULT_GIVENS
    # further held-out bands evaluated with eval_givens; the checkpoint kept is the best by the sum of
    # all bands' solve rates, so a harder band cannot be bought with a loss on the primary one unseen
    extra_eval_givens: list[tuple[int, int]] = []
    seed: int = 0
    threads: int = Field(2, ge=1)


def default_generation_config() -> dict:
    return {
        "max_denoising_steps": 48,
        "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": 0.4,
        "t_max": 0.8,
        "stability_threshold": 1,
        "confidence_threshold": 0.005,
        "max_new_tokens": stok.TARGET_LEN,
        "bos_token_id": stok.BOS_ID,
        "eos_token_id": [stok.EOS_ID, stok.TURN_END_ID],
        "pad_token_id": stok.PAD_ID,
    }


def build_model(name: str, seed: int) -> DiffusionGemma:
    config = ModelConfig.from_yaml(name)
    model = DiffusionGemma(config)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model


class PuzzlePool:
    """Base puzzles over the whole training range; every draw is a fresh symmetry of one of them.

    The pool is generated once (the curriculum only gates which puzzles may be drawn), so moving the
    curriculum costs no solver time, and each puzzle keeps the loss it last had for difficulty weighting.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed + 1)
        self.np_rng = np.random.default_rng(cfg.seed + 2)
        self.lo = -1
        self.puzzles = np.zeros((0, 81), dtype=np.int8)
        self.solutions = np.zeros((0, 81), dtype=np.int8)
        self.givens = np.zeros(0, dtype=np.int64)
        self.loss = np.zeros(0, dtype=np.float64)  # last per-example loss; NaN = never drawn

    def _generate(self) -> None:
        lo, hi = (
            min(self.cfg.givens[0], self.cfg.curriculum_start),
            max(self.cfg.max_givens, self.cfg.givens[1]),
        )
        pairs = [
            sudoku.generate_puzzle(self.rng, self.rng.randint(lo, hi)) for _ in range(self.cfg.pool_size)
        ]
        to_int = lambda s: [0 if c == "." else int(c) for c in s]
        self.puzzles = np.array([to_int(p) for p, _ in pairs], dtype=np.int8)
        self.solutions = np.array([to_int(s) for _, s in pairs], dtype=np.int8)
        self.givens = (self.puzzles > 0).sum(axis=1)
        self.loss = np.full(len(pairs), np.nan)

    def refresh(self, lo: int) -> None:
        """Admit puzzles with at least `lo` givens (all of them if none has that many)."""
        if not len(self.puzzles):
            self._generate()
        self.lo = lo

    def eligible(self) -> np.ndarray:
        idx = np.flatnonzero(self.givens >= self.lo)
        return idx if len(idx) else np.arange(len(self.puzzles))

    def draw(self, n: int) -> np.ndarray:
        """Pool indices: a `hard_fraction` share weighted by last loss, the rest uniform."""
        idx = self.eligible()
        n_hard = round(n * self.cfg.hard_fraction)
        uniform = self.np_rng.choice(idx, n - n_hard)
        if not n_hard:
            return uniform
        loss = self.loss[idx]
        seen = ~np.isnan(loss)
        w = np.where(seen, loss, loss[seen].max() if seen.any() else 1.0)
        w = np.maximum(w, 1e-6)
        return np.concatenate([uniform, self.np_rng.choice(idx, n_hard, p=w / w.sum())])

    def record(self, idx: np.ndarray, losses: np.ndarray) -> None:
        """Average with the previous loss: one draw's loss swings with its random noise level t."""
        old = self.loss[idx]
        self.loss[idx] = np.where(np.isnan(old), losses, 0.5 * (old + losses))

    def batch(self, n: int, idx: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.draw(n) if idx is None else idx
        p, s = sudoku.augment_batch(self.puzzles[idx], self.solutions[idx], self.np_rng)
        return torch.from_numpy(stok.prompt_ids_batch(p)), torch.from_numpy(stok.target_ids_batch(s))


def diffusion_loss(
    model: DiffusionGemma, prompt: torch.Tensor, target: torch.Tensor, cfg: TrainConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(diffusion CE, causal-LM CE) for a batch of equal-length prompts and canvases."""
    rows, ar = diffusion_loss_rows(model, prompt, target, cfg, gen)
    return rows.mean(), ar


def diffusion_loss_rows(
    model: DiffusionGemma, prompt: torch.Tensor, target: torch.Tensor, cfg: TrainConfig, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] per-example diffusion CE, causal-LM CE): the per-example losses drive difficulty weighting."""
    b, p_len = prompt.shape
    vocab = model.cfg.vocab_size
    window = model.cfg.sliding_window
    # the causal-LM loss needs the encoder over prompt + solution; the other rows only need the prompt's
    # K/V, so a quarter of the batch pays for the longer pass (the encoder is ~60% of the FLOPs)
    n_ar = max(1, int(b * cfg.ar_fraction))
    seq = torch.cat([prompt[:n_ar], target[:n_ar]], dim=1)
    pos = torch.arange(seq.shape[1])[None, :].expand(n_ar, -1)
    ones = torch.ones_like(pos, dtype=torch.bool)
    h, kv_ar = model.encode(seq, pos, attention_masks(pos, ones, None, True, window))
    ar = F.cross_entropy(model.logits(h[:, p_len - 1 : -1]).reshape(-1, vocab), target[:n_ar].reshape(-1))
    kv = kv_ar
    if n_ar < b:
        ppos = pos[:1, :p_len].expand(b - n_ar, -1)
        pones = torch.ones_like(ppos, dtype=torch.bool)
        _, kv_rest = model.encode(prompt[n_ar:], ppos, attention_masks(ppos, pones, None, True, window))
        kv = [
            (torch.cat([ka[:, :, :p_len], kr]), torch.cat([va[:, :, :p_len], vr]))
            for (ka, va), (kr, vr) in zip(kv_ar, kv_rest)
        ]
    pos = torch.arange(p_len + target.shape[1])[None, :].expand(b, -1)
    ones = torch.ones_like(pos, dtype=torch.bool)

    past = [(k[:, :, :p_len], v[:, :, :p_len]) for k, v in kv]
    ppos = pos[:, :p_len]
    meta = {
        "full_attention": KeyMeta(ppos, ones[:, :p_len]),
        "sliding_attention": KeyMeta(ppos, ppos >= p_len - (window - 1)),  # what the ring buffer would hold
    }
    cpos = pos[:, p_len:]
    masks = attention_masks(cpos, ones[:, p_len:], meta, False, window)
    t = cfg.t_eps + (1 - cfg.t_eps) * torch.rand(b, 1, generator=gen)
    noise = torch.randint(0, vocab, target.shape, generator=gen)
    corrupt = torch.rand(target.shape, generator=gen) < t
    if cfg.pin_prob > 0:
        given = torch.zeros_like(corrupt)
        given[:, : stok.TARGET_LEN - 1] = prompt[:, 2 : 2 + stok.TARGET_LEN - 1] != stok.DOT_ID
        pin = torch.rand(b, 1, generator=gen) < cfg.pin_prob
        corrupt &= ~(given & pin)
    noisy = torch.where(corrupt, noise, target)
    sc_probs = None
    use_sc = torch.rand(b, generator=gen) < cfg.sc_prob
    if bool(use_sc.any()):
        with torch.no_grad():
            first = model.denoise(noisy, None, cpos, masks, [(k.detach(), v.detach()) for k, v in past])
            sc_probs = torch.softmax(first, dim=-1) * use_sc[:, None, None]
    logits = model.denoise(noisy, sc_probs, cpos, masks, past)
    diff = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    return diff.reshape(b, -1).mean(dim=1), ar


def lr_at(step: int, frac: float, cfg: TrainConfig) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return cfg.lr * warm * cosine


def curriculum_lo(frac: float, cfg: TrainConfig) -> int:
    """Lowest givens in play: from curriculum_start down to givens[0] in integer stages."""
    x = min(frac / cfg.curriculum_fraction, 1.0) if cfg.curriculum_fraction > 0 else 1.0
    return round(cfg.curriculum_start + (cfg.givens[0] - cfg.curriculum_start) * x)


def train(
    cfg: TrainConfig,
    out: Path,
    resume: Path | None = None,
    log: Callable[[dict], None] = lambda row: None,
) -> Path:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model = load_model(resume)[0] if resume else build_model(cfg.model, cfg.seed)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    pool = PuzzlePool(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    bands = [tuple(cfg.eval_givens), *(tuple(b) for b in cfg.extra_eval_givens)]
    held_out = {b: sudoku.make_dataset(10_000 + cfg.seed, cfg.eval_n, b) for b in bands}
    best = -1.0
    check_replaceable(out, *SAVED_CHECKPOINT)  # before hours of training, not at the first save
    out.mkdir(parents=True, exist_ok=True)
    curve_path = out.parent / f"{out.name}.curve.jsonl"
    budget = cfg.minutes * 60
    start = time.perf_counter()
    # a warm start is evaluated before its first step: the curve starts from the weights it improves on
    next_eval = 0.0 if resume else cfg.eval_every_minutes * 60
    step = examples = 0
    ema: dict[str, float] = {}
    while True:
        elapsed = time.perf_counter() - start
        frac = elapsed / budget
        if cfg.max_steps is not None:
            frac = max(frac, step / cfg.max_steps)
        if frac >= 1.0 or elapsed >= next_eval:
            model.eval()
            reps = {b: eval_sudoku(model, held_out[b], b, SamplerConfig(), batch=64) for b in bands}
            model.train()
            rep = reps[bands[0]]
            score = sum(r.solve_rate for r in reps.values())
            row = {
                "minutes": round(elapsed / 60, 2),
                "step": step,
                "examples": examples,
                "solve_rate": rep.solve_rate,
                "valid_rate": rep.valid_rate,
                "mean_steps": rep.mean_steps,
                "curriculum_lo": pool.lo,
                **{k: round(v, 4) for k, v in ema.items()},
            }
            if len(bands) > 1:
                row["band_solve_rates"] = {f"{lo}-{hi}": r.solve_rate for (lo, hi), r in reps.items()}
            row["kept"] = score > best  # the checkpoint on disk is the best evaluation so far
            with open(curve_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            log(row)
            if row["kept"]:
                best = score
                save_trained(model, out, cfg, row, resume)
            next_eval = elapsed + cfg.eval_every_minutes * 60
            if frac >= 1.0:
                return out
        pool.refresh(curriculum_lo(frac, cfg))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, frac, cfg)
        idx = pool.draw(cfg.batch_size)
        prompt, target = pool.batch(cfg.batch_size, idx)
        rows, ar = diffusion_loss_rows(model, prompt, target, cfg, gen)
        pool.record(idx, rows.detach().numpy())
        diff = rows.mean()
        loss = diff + cfg.ar_loss_weight * ar
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        examples += cfg.batch_size
        for k, v in (("diff_loss", diff.item()), ("ar_loss", ar.item())):
            ema[k] = v if k not in ema else 0.98 * ema[k] + 0.02 * v
        if step % 100 == 0:
            log(
                {
                    "step": step,
                    "minutes": round(elapsed / 60, 2),
                    "ex_per_s": round(examples / elapsed, 1),
                    "lr": round(lr_at(step, frac, cfg), 6),
                    "curriculum_lo": pool.lo,
                    **{k: round(v, 4) for k, v in ema.items()},
                }
            )


def save_trained(
    model: DiffusionGemma, out: Path, cfg: TrainConfig, metrics: dict, resumed_from: Path | None = None
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        stok.save_tokenizer(td)
        extra = {f.name: f.read_bytes() for f in Path(td).iterdir()}
    save_checkpoint(
        model,
        out,
        generation_config=default_generation_config(),
        extra_files=extra,
        dgpipe_meta={
            "task": "sudoku",
            "prompt_format": "sudoku",  # pipeline.demo.prompt_format, looked up by pipeline.runtime
            "prompt_template": "<bos><|turn>{prompt}<turn|>",
            "trained_with": cfg.model_dump(mode="json"),
            "resumed_from": str(resumed_from) if resumed_from else None,  # a warm start's weights
            "metrics": metrics,
            "givens_range": list(cfg.eval_givens),  # the default band of `dgpipe eval sudoku` and benches
        },
    )
