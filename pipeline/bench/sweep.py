"""`dgpipe bench sweep`: accuracy against denoising steps and entropy bound, as JSON plus a PNG of the
accuracy/steps trade-off (with its Pareto front); every point carries its step policy.

The examples and their judgement are the model's prompt format's (`evaluation_examples`, `evaluate`: the
embedded model's format draws Sudoku puzzles of its givens band and counts exact solutions), so the sweep
runs on any model whose format evaluates its task and refuses others, naming what is missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.results import save_plot, save_result

SWEEP_JSON, SWEEP_PLOT = "sweep.json", "sweep.png"
SWEEP_SEED = 30_000  # the held-out examples of every point (apart from other evaluations')
HOOKS = ("evaluation_examples", "evaluate")


def run_sweep(
    model,
    bounds: list[float],
    steps: list[int],
    n: int,
    out: Path,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Solve rate per (bound, max steps) on the same n held-out examples; writes out/sweep.json + sweep.png,
    returns the result. `progress(k)` is told of every k examples done (len(bounds) * len(steps) * n in all)."""
    from pipeline.runtime.prompt_format import prompt_format_name, require_hooks
    from pipeline.runtime.session import load_session

    session = load_session(model)
    fmt = session.prompt_format
    require_hooks(fmt, HOOKS, "`dgpipe bench sweep`", session.checkpoint.path)
    examples = fmt.evaluation_examples(n, SWEEP_SEED)
    fmt.evaluate(session.model, examples[:1], session.sampler(), None)  # warm-up: the first point's tokens/s
    points: list[dict[str, Any]] = []
    for b in bounds:
        for s in steps:
            sampler = session.sampler(entropy_bound=b, max_denoising_steps=s)
            rep = fmt.evaluate(session.model, examples, sampler, progress)
            points.append(
                {
                    "entropy_bound": b,
                    "max_steps": s,
                    "solve_rate": rep.solve_rate,
                    "mean_steps": rep.mean_steps,
                    "p90_steps": rep.p90_steps,
                    "tokens_per_s": rep.tokens_per_s,
                }
            )
    pareto = pareto_front(points)
    result = {
        "model": str(session.checkpoint.path),
        "prompt_format": prompt_format_name(session.checkpoint),
        "n": n,
        "policy": f"adaptive (confidence {session.sampler().confidence_threshold:g})",
        "points": points,
        "pareto": pareto,
    }

    def draw(ax) -> None:
        for b in bounds:
            pts = sorted((p for p in points if p["entropy_bound"] == b), key=lambda p: p["mean_steps"])
            ax.plot(
                [p["mean_steps"] for p in pts],
                [100 * p["solve_rate"] for p in pts],
                "o-",
                label=f"bound {b:g}",
            )
        ax.plot(
            [p["mean_steps"] for p in pareto],
            [100 * p["solve_rate"] for p in pareto],
            "k--",
            lw=1,
            label="Pareto front",
        )
        ax.set_xlabel("mean denoising steps per canvas")
        ax.set_ylabel(f"solve rate, % of {n} held-out examples")
        ax.set_title("Entropy bound x max steps (adaptive stop)")
        ax.legend(fontsize=8)

    save_plot(out / SWEEP_PLOT, draw)
    save_result(out, SWEEP_JSON, result)
    return result


def pareto_front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on both fewer mean steps and a higher solve rate."""
    front = []
    for p in sorted(points, key=lambda p: (p["mean_steps"], -p["solve_rate"])):
        if not front or p["solve_rate"] > front[-1]["solve_rate"]:
            front.append(p)
    return front


def render(result: dict) -> list[str]:
    """The `dgpipe bench sweep` table: one line per (bound, max steps), the Pareto front starred."""
    rows = [
        f"{p['entropy_bound']:>7g}{p['max_steps']:>10}{100 * p['solve_rate']:>7.1f}%{p['mean_steps']:>12.1f}"
        f"{p['p90_steps']:>6.0f}{' *' if p in result['pareto'] else ''}"
        for p in result["points"]
    ]
    head = f"{'bound':>7}{'max steps':>10}{'solved':>8}{'mean steps':>12}{'p90':>6}"
    return [head, *rows, "* Pareto front"]
