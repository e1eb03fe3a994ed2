"""Sudoku evaluation of a checkpoint: the accuracy signal every later stage (quantize, ONNX, serve) reuses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

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


def select_arms(arms: str, decode: str = "diffusion", no_infill: bool = False) -> list[str]:
    """The arms of `dgpipe eval sudoku`: --arms (comma-separated, distinct), else the one arm that
    --decode and --no-infill name."""
    from pipeline.errors import DgpipeError

    if decode not in ("diffusion", "ar"):
        raise DgpipeError(f"--decode {decode!r}: choose diffusion or ar")
    if not arms:
        return [next(k for k, v in ARMS.items() if v == (decode, not no_infill))]
    if decode != "diffusion" or no_infill:
        raise DgpipeError("--arms replaces --decode and --no-infill", "drop one of them")
    chosen = [a.strip() for a in arms.split(",")]
    if any(a not in ARMS for a in chosen) or len(set(chosen)) != len(chosen):
        raise DgpipeError(f"--arms {arms!r}: choose distinct arms from {', '.join(ARMS)}")
    return chosen


@dataclass(frozen=True)
class SudokuEval:
    """One `dgpipe eval sudoku`: which weights, puzzles, arms and sampler settings."""

    model: Path | None  # None: the embedded model
    arms: list[str]
    n: int = 200
    bands: list[tuple[int, int]] = field(default_factory=list)  # empty: the model's givens range
    sampler: dict = field(default_factory=dict)  # SamplerConfig overrides (None: the model's)
    seed: int = 20_000
    batch: int = 50
    baseline: Path | None = None  # other weights as one more arm, "baseline"
    onnx: Path | None = None  # the exported ONNX dir, run by the runner the caller gives
    dtype: str = "auto"
    device: str = "auto"


@dataclass
class SudokuEvalResult:
    model: str
    n: int
    bands: list[BandComparison]
    summary: dict  # the first band's first arm, flat (what scripts reading one figure use) + the rest

    def table(self) -> list[str]:
        """One row per band and arm, then the paired tests: the BENCHMARKS.md table's shape."""
        lines = [
            f"Sudoku solver {self.model}: {self.n} held-out puzzles per band (same puzzles and seeds for "
            "every arm)",
            f"{'givens':<8} {'arm':<12} {'solved':>7} {'95% CI':>15} {'valid':>7} {'steps/canvas':>13} "
            f"{'p90':>4} {'tokens/s':>9}",
        ]
        for band in self.bands:
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


def run_sudoku_eval(
    spec: SudokuEval,
    runner_for: Callable[[Path], object] | None = None,
    progress_for: Callable[[str, int], Callable[[int], None]] | None = None,
) -> SudokuEvalResult:
    """Every arm (and the baseline) on the same held-out puzzles per band. `runner_for(checkpoint dir)`
    makes the runner for `spec.onnx` (the caller's backend); `progress_for(label, total)` a progress
    callback once the number of puzzles is known."""
    from pipeline.errors import DgpipeError

    if spec.n < 1:
        raise DgpipeError(f"--n must be >= 1 (got {spec.n})")
    session = _sudoku_session(spec.model, spec.dtype, spec.device, "")
    runner = session.model
    if spec.onnx is not None:  # same runtime and sampler state, network + sampler step in onnxruntime
        if "ar" in [ARMS[a][0] for a in spec.arms] or runner_for is None:
            raise DgpipeError("--onnx runs diffusion decoding only", "drop --decode ar / the ar arm")
        if spec.baseline is not None:
            raise DgpipeError("--baseline compares PyTorch checkpoints", "drop --onnx or --baseline")
        runner = runner_for(session.checkpoint.path)
    bands = spec.bands or [tuple(session.checkpoint.dgpipe.get("givens_range", (45, 61)))]
    sampler = session.sampler(**spec.sampler)
    base = None
    if spec.baseline is not None:
        base = _sudoku_session(spec.baseline, spec.dtype, spec.device, "--baseline ").model
    total = spec.n * len(bands) * (len(spec.arms) + (base is not None))
    label = f"{', '.join(spec.arms)} on {spec.n} puzzles x {len(bands)} bands"
    progress = progress_for(label, total) if progress_for is not None else None
    results = compare_arms(
        runner,
        bands,
        spec.arms,
        spec.n,
        spec.seed,
        sampler,
        spec.batch,
        progress,
        baseline=base,  # type: ignore[arg-type]
    )
    model = str(session.checkpoint.path)
    summary = next(iter(results[0].arms.values())).as_dict() | {
        "model": model,
        "task": "Sudoku solver",
        "seed": spec.seed,
        "sampler": sampler.model_dump(),
        "baseline": str(spec.baseline) if spec.baseline is not None else None,
        "bands": [b.as_dict() for b in results],
    }
    if spec.onnx is not None:
        summary["onnx"] = str(spec.onnx)
    return SudokuEvalResult(model, spec.n, results, summary)


def _sudoku_session(model: Path | None, dtype: str, device: str, flag: str):
    """A loaded session of a Sudoku checkpoint (another task's checkpoint is refused by name)."""
    from pipeline.errors import DgpipeError
    from pipeline.runtime.prompt_format import prompt_format_name
    from pipeline.runtime.session import load_session

    session = load_session(model, dtype, device)
    if prompt_format_name(session.checkpoint) != "sudoku":
        if flag:
            raise DgpipeError(f"{flag}{model} is not a Sudoku model")
        raise DgpipeError(
            f"{session.checkpoint.path} is not a Sudoku model (dgpipe.json prompt format is not 'sudoku')"
        )
    return session
