"""Accuracy report of quantized checkpoints against the bf16 reference, for a model whose prompt format
evaluates its task (`evaluation_examples`, `answer_ids`, `evaluate`, as the embedded model's format does).

Per precision: the format's solve rate and mean denoise steps per canvas on one fixed example set (same
seed, same sampler, same draws), mean KL(bf16 || quantized) of denoise logits on one fixed canvas set,
and checkpoint bytes. Every checkpoint is evaluated by dgpipe's runtime from the exported files
(dequantized on load, activations fake-quantized), never from ModelOpt's in-memory model.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.errors import DgpipeError
from pipeline.runtime.prompt_format import Example, PromptFormat

KL_NOISE_LEVELS = (1.0, 0.5, 0.1)  # fraction of free canvas cells re-noised (1.0 = the first denoise step)


@dataclass
class Row:
    precision: str
    checkpoint: str
    bytes: int
    solve_rate: float
    valid_rate: float
    mean_steps: float
    p90_steps: float
    kl_vs_bf16: float
    drop_points: float  # bf16 solve rate minus this one, in percentage points


@dataclass
class CanvasSet:
    """Fixed denoiser inputs: prompts, canvases and the self-conditioning probabilities of step 2."""

    prompts: torch.Tensor  # [N, P]
    canvases: torch.Tensor  # [N, C]


def canvas_set(
    fmt: PromptFormat, examples: list[Example], canvas_length: int, vocab: int, seed: int = 7
) -> CanvasSet:
    """Each example's reference answer as a canvas, its free cells (not pinned by the prompt's template)
    re-noised at each of KL_NOISE_LEVELS."""
    gen = torch.Generator().manual_seed(seed)
    prompts, canvases = [], []
    for level in KL_NOISE_LEVELS:
        for ex in examples:
            target = torch.tensor(fmt.answer_ids(ex.answer)[:canvas_length])
            template = fmt.infill_template(ex.prompt) or [-1] * len(target)
            free = torch.tensor([t == -1 for t in template[: len(target)]])
            noised = free & (torch.rand(target.shape, generator=gen) < level)
            canvases.append(torch.where(noised, torch.randint(0, vocab, target.shape, generator=gen), target))
            prompts.append(torch.tensor(fmt.encode_prompt(ex.prompt)))
    return CanvasSet(torch.stack(prompts), torch.stack(canvases))


@torch.no_grad()
def denoise_logits(model, cs: CanvasSet, sc_probs: torch.Tensor | None) -> torch.Tensor:
    """Denoise logits [N, C, V] for the fixed canvases after a causal prefill of the prompts."""
    from pipeline.runtime.kv_cache import KeyMeta, attention_masks

    b, p_len = cs.prompts.shape
    window = model.cfg.sliding_window
    ppos = torch.arange(p_len)[None].expand(b, -1)
    ones = torch.ones_like(ppos, dtype=torch.bool)
    _, kv = model.encode(cs.prompts, ppos, attention_masks(ppos, ones, None, True, window))
    meta = {
        "full_attention": KeyMeta(ppos, ones),
        "sliding_attention": KeyMeta(ppos, ppos >= p_len - (window - 1)),
    }
    cpos = p_len + torch.arange(cs.canvases.shape[1])[None].expand(b, -1)
    masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, window)
    return model.denoise(cs.canvases, sc_probs, cpos, masks, kv).float()


def mean_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(p_ref || p_q) in nats, at temperature 1."""
    lp, lq = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def kl_pair(ref_model, model, cs: CanvasSet) -> float:
    """Both denoise steps of the fixed set: without self-conditioning, then with the reference's step-1
    probabilities as self-conditioning input (same input for both models)."""
    ref0 = denoise_logits(ref_model, cs, None)
    sc = torch.softmax(ref0, -1)
    ref1 = denoise_logits(ref_model, cs, sc)
    return statistics.fmean(
        [mean_kl(ref0, denoise_logits(model, cs, None)), mean_kl(ref1, denoise_logits(model, cs, sc))]
    )


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def build_report(
    model: Path,
    precisions: list[str],
    out_dir: Path,
    n: int,
    seed: int,
    calib_size: int,
    max_drop: float,
    kl_puzzles: int = 32,
    log: Callable[[str], None] = lambda s: None,
    progress_factory: Callable[[str, int], Callable[[int], None]] | None = None,
) -> list[Row]:
    """Quantize the model to each precision (bf16 always included: the reference), evaluate each export
    with the prompt format's evaluation."""
    from pipeline.runtime.session import load_session
    from quantize.run import QuantizeOptions, quantize_checkpoint

    order = ["bf16", *[p for p in precisions if p != "bf16"]]
    paths: dict[str, Path] = {}
    for p in order:
        log(f"quantize {p} ...")
        res = quantize_checkpoint(
            QuantizeOptions(model=model, precision=p, output=out_dir / p, calib_size=calib_size)
        )
        paths[p] = Path(res.output)
    ref = load_session(paths["bf16"], "float32", "cpu")
    fmt = ref.prompt_format
    if not all(hasattr(fmt, m) for m in ("evaluation_examples", "answer_ids", "evaluate")):
        raise DgpipeError(
            f"{model}: its prompt format has no task evaluation (evaluation_examples, answer_ids, evaluate)",
            "the accuracy report needs a task model such as the embedded one",
        )
    examples = fmt.evaluation_examples(n, seed)
    cs = canvas_set(fmt, examples[:kl_puzzles], ref.model.config.canvas_length, ref.model.cfg.vocab_size)
    rows: list[Row] = []
    for p in order:
        s = ref if p == "bf16" else load_session(paths[p], "float32", "cpu")
        prog = progress_factory(f"eval {p}", n) if progress_factory else None
        rep = s.prompt_format.evaluate(s.model, examples, s.sampler(), prog)
        kl = 0.0 if p == "bf16" else kl_pair(ref.model, s.model, cs)
        base = rows[0].solve_rate if rows else rep.solve_rate
        rows.append(
            Row(
                precision=p,
                checkpoint=str(paths[p]),
                bytes=checkpoint_bytes(paths[p]),
                solve_rate=rep.solve_rate,
                valid_rate=rep.valid_rate,
                mean_steps=rep.mean_steps,
                p90_steps=rep.p90_steps,
                kl_vs_bf16=kl,
                drop_points=round(100 * (base - rep.solve_rate), 2),
            )
        )
        log(f"{p}: solved {rep.solve_rate:.1%}, steps {rep.mean_steps:.2f}, KL {kl:.2e}")
    return rows


def gate(rows: list[Row], max_drop: float) -> None:
    """Fail when a precision's solve rate is more than `max_drop` points below bf16."""
    bad = [r for r in rows if r.drop_points > max_drop]
    if bad:
        worst = ", ".join(
            f"{r.precision} {100 * r.solve_rate:.1f}% ({r.drop_points:+.1f} points below bf16)" for r in bad
        )
        raise DgpipeError(
            f"accuracy gate failed: {worst}; allowed drop is {max_drop} points",
            "exclude sensitive layers with --exclude, calibrate on more data, or pick a wider precision",
        )


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def table(rows: list[Row]) -> str:
    head = "| precision | solve rate | drop vs bf16 | valid rate | steps/canvas (mean, p90) | KL(bf16‖q) | checkpoint bytes |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.precision} | {100 * r.solve_rate:.1f}% | {r.drop_points:+.1f} pt | {100 * r.valid_rate:.1f}% | "
            f"{r.mean_steps:.2f}, {r.p90_steps:.0f} | {r.kl_vs_bf16:.2e} | {r.bytes:,} |"
        )
    return "\n".join(lines)
