"""Sudoku evaluation of a checkpoint: the accuracy signal every later stage (quantize, ONNX, serve) reuses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from pipeline.demo import sudoku
from pipeline.demo import tokenizer as stok
from pipeline.demo.stats import McNemar, mcnemar, wilson_interval
from pipeline.limits import context_length
from pipeline.model.config import SamplerConfig
from pipeline.model.network import DiffusionGemma
from pipeline.runtime.autoregressive import ar_generate
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request


@dataclass
class SudokuReport:
    n: int
    givens: tuple[int, int]
    decode: str
    infill: bool
    solve_rate: float
    valid_rate: float
    mean_steps: float
    p90_steps: float
    tokens_per_s: float
    seconds: float
    outcomes: list[bool] = field(default_factory=list, repr=False)  # solved, per puzzle, in order

    @property
    def solve_ci95(self) -> tuple[float, float]:
        return wilson_interval(sum(self.outcomes), self.n)

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["outcomes"]  # per-puzzle detail: what the paired tests consume, not a figure to print
        return d | {"solve_ci95": list(self.solve_ci95)}


def p90(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, round(0.9 * (len(s) - 1)))])


@torch.no_grad()
def eval_sudoku(
    model: DiffusionGemma,
    puzzles: list[tuple[str, str]],
    givens: tuple[int, int],
    sampler: SamplerConfig | None = None,
    decode: str = "diffusion",
    infill: bool = True,
    batch: int = 32,
    seed: int = 0,
    progress=None,
) -> SudokuReport:
    """Solve rate = exact match with the unique solution; valid rate = any constraint-valid full grid
    (ignoring the givens), which separates "almost a Sudoku" from "a different valid grid"."""
    sampler = sampler or SamplerConfig()
    valid = 0
    outcomes: list[bool] = []
    steps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for lo in range(0, len(puzzles), batch):
        chunk = puzzles[lo : lo + batch]
        prompts = [stok.sudoku_prompt_ids(p) for p, _ in chunk]
        templates = [stok.sudoku_infill_template(p) for p, _ in chunk] if infill else None
        if decode == "ar":
            outs, passes = ar_generate(model, prompts, stok.TARGET_LEN, templates)
            steps.extend([float(passes)] * len(chunk))
        else:
            rt = BlockDiffusionRuntime(
                model,
                max_batch=len(chunk),
                max_len=context_length(stok.PROMPT_LEN, 0, model.config.canvas_length),
            )
            reqs = [
                Request(
                    prompt_ids=pr,
                    max_tokens=stok.TARGET_LEN,
                    sampler=sampler,
                    seed=seed,
                    request_id=lo + i,
                    template=templates[i] if templates else None,
                )
                for i, pr in enumerate(prompts)
            ]
            results = rt.generate(reqs)
            outs = [r.tokens for r in results]
            steps.extend(float(r.steps_per_canvas[0]) for r in results)
        for (_puzzle, solution), out in zip(chunk, outs):
            tokens += len(out)
            cand = stok.decode_solution(out)
            outcomes.append(cand == solution)
            valid += sudoku.constraint_valid(cand)
        if progress is not None:
            progress(len(chunk))
    secs = time.perf_counter() - start
    n = max(len(puzzles), 1)
    return SudokuReport(
        n=len(puzzles),
        givens=givens,
        decode=decode,
        infill=infill,
        solve_rate=sum(outcomes) / n,
        valid_rate=valid / n,
        mean_steps=statistics.fmean(steps) if steps else 0.0,
        p90_steps=p90(steps),
        tokens_per_s=tokens / secs if secs > 0 else 0.0,
        seconds=secs,
        outcomes=outcomes,
    )


# a comparison arm: how the same weights decode the same puzzles
ARMS: dict[str, tuple[str, bool]] = {
    "pinned": ("diffusion", True),  # the default: givens pinned in the canvas (infill)
    "unpinned": ("diffusion", False),  # the model copies the givens from the prompt itself
    "ar": ("ar", True),  # left-to-right with the KV cache, givens forced
    "ar-unpinned": ("ar", False),
}


@dataclass
class BandComparison:
    """Every arm on one band's puzzles (same puzzles and seeds), with each pair of arms tested."""

    givens: tuple[int, int]
    arms: dict[str, SudokuReport]
    tests: list[McNemar]

    def as_dict(self) -> dict:
        return {
            "givens": list(self.givens),
            "n": next(iter(self.arms.values())).n,
            "arms": {k: r.as_dict() for k, r in self.arms.items()},
            "mcnemar": [t.as_dict() for t in self.tests],
        }


def compare_arms(
    model: DiffusionGemma,
    bands: Sequence[tuple[int, int]],
    arms: Sequence[str],
    n: int,
    seed: int,
    sampler: SamplerConfig | None = None,
    batch: int = 50,
    progress: Callable[[int], None] | None = None,
    baseline: DiffusionGemma | None = None,
) -> list[BandComparison]:
    """Per band: `n` fresh puzzles (seeded, so every arm and every run sees the same ones), each arm on
    them with the same sampler seeds, and McNemar's test for every pair of arms. `baseline`: other weights
    (e.g. the previous checkpoint), decoded the default way (givens pinned) with the same sampler settings
    and seeds, as one more arm named "baseline"."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arms {unknown}: choose from {list(ARMS)}")
    out = []
    for band in bands:
        puzzles = sudoku.make_dataset(seed, n, band)
        reps = {
            a: eval_sudoku(
                model,
                puzzles,
                band,
                sampler,
                decode=ARMS[a][0],
                infill=ARMS[a][1],
                batch=batch,
                progress=progress,
            )
            for a in arms
        }
        if baseline is not None:
            reps["baseline"] = eval_sudoku(
                baseline, puzzles, band, sampler, "diffusion", True, batch=batch, progress=progress
            )
        names = list(reps)
        tests = [
            mcnemar(x, reps[x].outcomes, y, reps[y].outcomes)
            for i, x in enumerate(names)
            for y in names[i + 1 :]
        ]
        out.append(BandComparison(band, reps, tests))
    return out
