"""`dgpipe bench guided`: what constrained decoding costs. The same requests (Sudoku puzzles with their givens
pinned, same seeds, same sampler) run unconstrained and under the regex `[1-9]{81}`, alternating run by run
so both see the same machine load; medians of denoise passes per canvas and wall time, and their ratios."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.results import save_result

RESULT_FILE = "bench_guided.json"
GRID_REGEX = "[1-9]{81}"


@dataclass
class Row:
    policy: str  # step policy
    batch: int
    passes_per_canvas: float  # unconstrained, median over runs
    passes_per_canvas_guided: float
    ms_total: float  # wall time
    ms_total_guided: float
    cpu_ms_total: float  # this process's CPU time: what the work costs, robust to other jobs' load
    cpu_ms_total_guided: float
    valid: float  # fraction of unconstrained outputs that match the regex
    valid_guided: float
    solved: float  # fraction of puzzles solved (the answer's quality, not only its form)
    solved_guided: float

    @property
    def passes_ratio(self) -> float:
        return self.passes_per_canvas_guided / self.passes_per_canvas

    @property
    def time_ratio(self) -> float:
        return self.ms_total_guided / self.ms_total

    @property
    def cpu_time_ratio(self) -> float:
        return self.cpu_ms_total_guided / self.cpu_ms_total


def _run(session, puzzles: list[str], sampler, guide, seed: int) -> tuple[float, ...]:
    """One batch to completion: (denoise passes per canvas, seconds, fraction of outputs in the language,
    fraction solved, CPU seconds)."""
    import re

    from pipeline.demo import sudoku
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    rt = BlockDiffusionRuntime(session.model, max_batch=len(puzzles))
    reqs = [
        Request(
            prompt_ids=session.encode_prompt(p),
            max_tokens=82,
            sampler=sampler,
            seed=seed,
            request_id=i,
            template=session.default_template(p),
            guide=guide,
        )
        for i, p in enumerate(puzzles)
    ]
    with torch.inference_mode():
        t, cpu = time.perf_counter(), time.process_time()
        res = rt.generate(reqs)
        secs, cpu = time.perf_counter() - t, time.process_time() - cpu
    canvases = sum(len(r.steps_per_canvas) for r in res)
    steps = sum(sum(r.steps_per_canvas) for r in res)
    texts = [session.decode(r.tokens) for r in res]
    valid = sum(bool(re.fullmatch(GRID_REGEX, t)) for t in texts) / len(res)
    solved = sum(sudoku.is_valid_solution(p, t) for p, t in zip(puzzles, texts, strict=True)) / len(res)
    return steps / canvases, secs, valid, solved, cpu


def run_bench_guided(out: Path, batches: list[int], runs: int, fixed_steps: int) -> dict[str, Any]:
    from pipeline.demo import sudoku
    from pipeline.runtime.session import load_session
    from pipeline.threads import thread_count

    session = load_session(device="cpu", dtype="float32")
    guide = session.compile_guide("regex", GRID_REGEX)
    givens = tuple(session.checkpoint.dgpipe["givens_range"])
    steps = session.sampler().max_denoising_steps
    policies = {
        f"adaptive <= {steps}": session.sampler(),
        f"fixed {fixed_steps}": session.sampler(max_denoising_steps=fixed_steps, confidence_threshold=0.0),
    }
    rows = []
    for policy, sampler in policies.items():
        for batch in batches:
            puzzles = [p for p, _ in sudoku.make_dataset(2026 + batch, batch, givens)]
            samples: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
            for r in range(runs + 1):  # run 0 warms up both
                for guided in (False, True) if r % 2 == 0 else (True, False):
                    s = _run(session, puzzles, sampler, guide if guided else None, seed=r)
                    if r:
                        samples[guided].append(s)
            plain, constrained = (
                [statistics.median(x[i] for x in samples[g]) for i in range(5)] for g in (False, True)
            )
            rows.append(
                Row(
                    policy=policy,
                    batch=batch,
                    passes_per_canvas=plain[0],
                    passes_per_canvas_guided=constrained[0],
                    ms_total=1000 * plain[1],
                    ms_total_guided=1000 * constrained[1],
                    cpu_ms_total=1000 * plain[4],
                    cpu_ms_total_guided=1000 * constrained[4],
                    valid=plain[2],
                    valid_guided=constrained[2],
                    solved=plain[3],
                    solved_guided=constrained[3],
                )
            )
    result = {
        "hardware": f"{platform.processor() or platform.machine()}, {thread_count()} threads",
        "model": "embedded Sudoku model (fp32, CPU)",
        "regex": GRID_REGEX,
        "runs": runs,
        "rows": [
            {
                **asdict(r),
                "passes_ratio": r.passes_ratio,
                "time_ratio": r.time_ratio,
                "cpu_time_ratio": r.cpu_time_ratio,
            }
            for r in rows
        ],
    }
    save_result(out, RESULT_FILE, result)
    return result
