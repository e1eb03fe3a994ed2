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
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.bench.machine import cpu_model
from pipeline.bench.plots import guided_plot
from pipeline.bench.results import save_result

RESULT_FILE, PLOT_FILE = "bench_guided.json", "bench_guided.png"
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


def _validator(schema: dict[str, Any]):
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def guide_walk(guide, vocab_size: int, seed: int, room: int = 128, canvas: int = 32) -> list[int]:
    """One model-free output of a compiled guide: canvases of random, peaked distributions completed left
    to right by the runtime's own `finish_canvas` (exact masks, budget forcing, state across canvases).
    Ends with the end token, or is `room` tokens long when the guide could not force its end."""
    from pipeline.runtime.guided import GuideState, finish_canvas

    gen = torch.Generator().manual_seed(seed)
    g, tokens = GuideState(guide, room), []
    while not g.ended and len(tokens) < room:
        g.start_canvas(len(tokens))
        probs = torch.rand(canvas, vocab_size, generator=gen) ** 8
        tokens += finish_canvas(g, [PAD] * canvas, probs, PAD)
    ends = [i for i, t in enumerate(tokens) if t in guide.end_ids]
    return tokens[: ends[0] + 1] if ends else tokens[:room]


class _RawEngine:
    """An engine's own JSON-schema compiler and matcher, as its users call it (defaults), for comparison."""

    def __init__(self, name: str, vocab: dict[int, bytes], size: int):
        from pipeline.sampler.grammar import CLOSING_BYTES

        self.name, self.size = name, size
        tokens = [vocab.get(i, b"") for i in range(size)]
        by_bytes = {b: i for i, b in vocab.items()}
        self.closing = [by_bytes[bytes([c])] for c in CLOSING_BYTES if bytes([c]) in by_bytes]
        if name == "llguidance":
            import llguidance

            from pipeline.sampler.grammar import llg_tokenizer

            self.llg, self.tok = llguidance, llg_tokenizer(vocab, size, [END])
        else:
            import xgrammar

            info = xgrammar.TokenizerInfo(
                [t or b"<special_%d>" % i for i, t in enumerate(tokens)],
                vocab_type=xgrammar.VocabType.RAW,
                vocab_size=size,
                stop_token_ids=[END],
            )
            self.xgr, self.compiler = xgrammar, xgrammar.GrammarCompiler(info, max_threads=1)
            self.bitmask = xgrammar.allocate_token_bitmask(1, size)

    def compile(self, schema: dict[str, Any]) -> Any:
        if self.name == "llguidance":
            m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_json_schema(schema), log_level=0)
            if m.is_error():
                raise ValueError(m.get_error())
            return m
        return self.compiler.compile_json_schema(json.dumps(schema))

    def walk(self, compiled: Any, rng: random.Random, room: int) -> list[int] | None:
        """Tokens from the masks — half the time a random one, else the first closing byte allowed, always
        the latter past half the room — the end token taken with probability 0.3 where allowed; None when
        the walk did not end within `room` tokens."""
        m = compiled.deep_copy() if self.name == "llguidance" else self.xgr.GrammarMatcher(compiled)
        out: list[int] = []
        for step in range(room):
            if self.name == "llguidance":
                bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            else:
                m.fill_next_token_bitmask(self.bitmask)
                bits = self.bitmask[0].numpy().view(np.uint8)
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.size]).tolist()
            if END in allowed and (rng.random() < 0.3 or len(allowed) == 1):
                return out
            choices = [t for t in allowed if t != END]
            if not choices:
                return None
            allowed_set = set(choices)
            closing = next((t for t in self.closing if t in allowed_set), None)
            random_pick = rng.random() < 0.5 and step < room // 2
            tok = rng.choice(choices) if random_pick or closing is None else closing
            ok = m.consume_token(tok) if self.name == "llguidance" else m.accept_token(tok)
            if not ok:
                return None
            out.append(tok)
        return None


def bench_schemas(
    rows: list[dict[str, Any]],
    vocab: dict[int, bytes],
    engines: Sequence[str] = ("dgpipe", "llguidance", "xgrammar"),
    walks: int = 2,
    room: int = 128,
) -> dict[str, dict[str, dict[str, float]]]:
    """Per engine and JSONSchemaBench set: schemas, compiled %, refused %, walks that ended, valid % of
    those (jsonschema), compile ms p50/p95. `dgpipe` is this package's guide (walked by the runtime's
    completion); the others are the engines called directly with their defaults (skipped if missing)."""
    from pipeline.errors import InputError
    from pipeline.sampler.constraints import GuideSpec

    size = max(vocab) + 1
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in engines:
        try:
            engine = vocab_compiler(vocab, [END]) if name == "dgpipe" else _RawEngine(name, vocab, size)
        except ImportError:
            continue
        if name == "dgpipe":  # its engine's tokenizer is built on the first compile: not a schema's cost
            engine.compile(GuideSpec("json_schema", '{"type": "integer"}'))
        stats: dict[str, dict[str, list]] = {}
        for r in rows:
            sts = [
                stats.setdefault(k, {"n": [], "compile": [], "ended": [], "valid": []})
                for k in (r["set"], "all")
            ]
            for st in sts:
                st["n"].append(1)
            t = time.perf_counter()
            try:
                if name == "dgpipe":
                    compiled = engine.compile(GuideSpec("json_schema", json.dumps(r["schema"])))
                else:
                    compiled = engine.compile(r["schema"])
            except (InputError, ValueError, RuntimeError):
                continue
            for st in sts:
                st["compile"].append(time.perf_counter() - t)
            check, rng = _validator(r["schema"]), random.Random(0)
            too_long = name == "dgpipe" and compiled.min_tokens > room  # a request would be refused
            for seed in range(0 if too_long else walks):
                if name == "dgpipe":
                    toks = guide_walk(compiled, size, seed, room)
                    toks = toks[:-1] if toks and toks[-1] == END else None
                else:
                    toks = engine.walk(compiled, rng, room)
                if toks is None:
                    continue
                try:
                    value = json.loads(b"".join(vocab.get(t, b"") for t in toks).decode())
                    valid = not any(True for _ in check.iter_errors(value))
                except ValueError:
                    valid = False
                for st in sts:
                    st["ended"].append(1)
                    st["valid"].append(valid)
        out[name] = {
            s: {
                "schemas": len(v["n"]),
                "compiled_pct": 100 * len(v["compile"]) / len(v["n"]),
                "refused_pct": 100 - 100 * len(v["compile"]) / len(v["n"]),
                "walks_ended": len(v["ended"]),
                "valid_pct": 100 * sum(v["valid"]) / len(v["valid"]) if v["valid"] else float("nan"),
                "compile_ms_p50": 1000 * _pct(v["compile"], 50),
                "compile_ms_p95": 1000 * _pct(v["compile"], 95),
            }
            for s, v in stats.items()
        }
    return out


SCHEMAS_RESULT_FILE = "bench_guided_schemas.json"


def run_bench_schemas(out: Path, stride: int = 1, vocab_size: int = 4096, walks: int = 2) -> dict[str, Any]:
    """The per-set engine table over every `stride`-th schema of the sample, on a byte-level BPE vocabulary
    of `vocab_size` trained on the sample itself; saved as SCHEMAS_RESULT_FILE."""
    rows = load_sample()
    vocab = bpe_vocab([json.dumps(r["schema"]) for r in rows], vocab_size)
    result = {
        "hardware": cpu_model(),
        "vocab": f"byte-level BPE, {vocab_size} tokens, trained on the sample",
        "schemas": len(rows[::stride]),
        "walks_per_schema": walks,
        "engines": bench_schemas(rows[::stride], vocab, walks=walks),
    }
    result["not_installed"] = [e for e in ("llguidance", "xgrammar") if e not in result["engines"]]
    save_result(out, SCHEMAS_RESULT_FILE, result)
    return result


def schemas_table(result: dict[str, Any]) -> str:
    """The per-set table (Markdown) of a run_bench_schemas result, one row per set and engine, then all."""
    lines = [
        "| set | engine | compiled % | refused % | walks ended | valid % | compile p50 ms | compile p95 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    engines = result["engines"]
    sets = [*sorted({s for per in engines.values() for s in per} - {"all"}), "all"]
    for s in sets:
        for name, per in engines.items():
            x = per[s]
            lines.append(
                f"| {s} | {name} | {x['compiled_pct']:.0f} | {x['refused_pct']:.0f} | {x['walks_ended']} | "
                f"{x['valid_pct']:.1f} | {x['compile_ms_p50']:.1f} | {x['compile_ms_p95']:.1f} |"
            )
    if result.get("not_installed"):
        missing = " ".join(result["not_installed"])
        lines.append(f"\nnot measured (not installed): {missing}; `pip install {missing}` to compare")
    return "\n".join(lines)


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
        "hardware": f"{cpu_model()}, {thread_count()} threads",
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
    guided_plot(result, out / PLOT_FILE)
    return result


def render(r: dict) -> list[str]:
    """The `dgpipe bench guided` table: one line per policy and batch, guided beside unconstrained."""
    head = (
        f"{r['model']}, {r['hardware']}: regex {r['regex']} vs unconstrained, medians of {r['runs']} runs\n"
        f"{'policy':<16}{'batch':>5}{'passes/canvas':>14}{'guided':>8}{'x':>6}{'ms':>9}{'guided':>9}{'x':>6}"
        f"{'cpu x':>7}{'valid':>7}{'guided':>8}{'solved':>8}{'guided':>8}"
    )
    return [head] + [
        f"{x['policy']:<16}{x['batch']:>5}{x['passes_per_canvas']:>14.2f}{x['passes_per_canvas_guided']:>8.2f}"
        f"{x['passes_ratio']:>6.2f}{x['ms_total']:>9.1f}{x['ms_total_guided']:>9.1f}{x['time_ratio']:>6.2f}"
        f"{x['cpu_time_ratio']:>7.2f}{x['valid']:>7.2f}{x['valid_guided']:>8.2f}{x['solved']:>8.2f}{x['solved_guided']:>8.2f}"
        for x in r["rows"]
    ]
