"""`dgpipe bench guided`: what constrained decoding costs. The same requests (Sudoku puzzles with their givens
pinned, same seeds, same sampler) run unconstrained and under the regex `[1-9]{81}`, alternating run by run
so both see the same machine load; medians of denoise passes per canvas and wall time, and their ratios.

Beside it, the grammar engine's own cost on real schemas (the committed JSONSchemaBench sample): compile
time and per-step mask time over a 262,144-token synthetic vocabulary (Gemma's size), and `bench_schemas`,
the per-set table (compiled / refused / valid walks / compile p50, p95) that docs/benchmarks/constrained.md
quotes, with llguidance and XGrammar themselves measured by the same code where they are installed."""

from __future__ import annotations

import gzip
import json
import platform
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.bench.results import save_result

RESULT_FILE = "bench_guided.json"
GRID_REGEX = "[1-9]{81}"
SAMPLE = Path(__file__).parents[2] / "tests" / "data" / "jsonschemabench" / "sample.jsonl.gz"
GEMMA_VOCAB = 262_144
PAD, END = 0, 1  # the synthetic vocabularies' special ids


def load_sample() -> list[dict[str, Any]]:
    """The committed JSONSchemaBench sample: {"set", "name", "schema"} per schema (PROVENANCE.md beside it)."""
    return [json.loads(line) for line in gzip.decompress(SAMPLE.read_bytes()).decode().splitlines()]


def synthetic_vocab(size: int, seed: int = 0) -> dict[int, bytes]:
    """ids 0/1 special (pad, end), then the 256 single bytes, then distinct random printable strings of 2-8
    characters: a vocabulary of a real model's size without its files."""
    rng = random.Random(seed)
    vocab = {2 + b: bytes([b]) for b in range(256)}
    seen = set(vocab.values())
    printable = bytes(range(32, 127))
    while len(vocab) < size - 2:
        tok = bytes(rng.choice(printable) for _ in range(rng.randint(2, 8)))
        if tok not in seen:
            seen.add(tok)
            vocab[len(vocab) + 2] = tok
    return vocab


def bpe_vocab(texts: Sequence[str], size: int) -> dict[int, bytes]:
    """A byte-level BPE vocabulary trained on `texts` (ids 0/1 special): the shape of a real tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pipeline.sampler.constraints import token_bytes

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return token_bytes(tok, size)


def vocab_compiler(vocab: dict[int, bytes], end_ids: Sequence[int]):
    from pipeline.sampler.constraints import GuideCompiler

    return GuideCompiler.from_vocab(vocab, max(vocab) + 1, end_ids)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def grammar_costs(
    rows: list[dict[str, Any]], vocab_size: int = GEMMA_VOCAB, steps: int = 32
) -> dict[str, Any]:
    """Compile time of each schema and the per-step cost of a request's walk (the frontier mask plus the
    budget check of taking a token) over a synthetic vocabulary of `vocab_size` tokens."""
    from pipeline.errors import InputError
    from pipeline.sampler.constraints import GuideSpec

    t = time.perf_counter()
    compiler = vocab_compiler(synthetic_vocab(vocab_size), [END])
    compiler.compile(GuideSpec("json_schema", '{"type": "integer"}'))  # builds the engine's tokenizer
    setup = time.perf_counter() - t
    compile_s, mask_s, step_s, refused, errors = [], [], [], 0, 0
    rng = np.random.default_rng(0)
    for r in rows:
        t = time.perf_counter()
        try:
            guide = compiler.compile(GuideSpec("json_schema", json.dumps(r["schema"])))
        except InputError:
            refused += 1
            continue
        compile_s.append(time.perf_counter() - t)
        try:
            _walk_costs(guide, steps, rng, mask_s, step_s)
        except RuntimeError:  # the engine stopped with an error (a parser limit) mid-walk
            errors += 1
    return {
        "vocab_size": vocab_size,
        "schemas": len(rows),
        "refused": refused,
        "walk_errors": errors,
        "tokenizer_setup_ms": 1000 * setup,
        "compile_ms_p50": 1000 * _pct(compile_s, 50),
        "compile_ms_p95": 1000 * _pct(compile_s, 95),
        "compile_ms_max": 1000 * max(compile_s, default=float("nan")),
        "mask_ms_p50": 1000 * _pct(mask_s, 50),
        "mask_ms_p95": 1000 * _pct(mask_s, 95),
        "step_ms_p50": 1000 * _pct(step_s, 50),
        "step_ms_p95": 1000 * _pct(step_s, 95),
    }


def _walk_costs(guide, steps: int, rng, mask_s: list[float], step_s: list[float]) -> None:
    """Random tokens through one request's walk, timing the mask and the budget-checked step apart."""
    walk, state, room = guide.for_request(), 0, 4 * steps
    for i in range(steps):
        t = time.perf_counter()
        allowed = walk.allowed(state, room - i)
        mask_s.append(time.perf_counter() - t)
        if walk.is_final(state) or len(allowed) == 0:
            break
        t = time.perf_counter()
        tok = int(allowed[rng.integers(len(allowed))])
        nxt = walk.step(state, tok, room - i)
        state = nxt if nxt is not None else walk.step(state, walk.forced(state, room - i), room - i)
        step_s.append(time.perf_counter() - t)


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


def run_bench_guided(
    out: Path, batches: list[int], runs: int, fixed_steps: int, schema_stride: int = 50
) -> dict[str, Any]:
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
        # every schema_stride-th schema of the JSONSchemaBench sample, over Gemma's vocabulary size
        "grammar": grammar_costs(load_sample()[::schema_stride]),
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
