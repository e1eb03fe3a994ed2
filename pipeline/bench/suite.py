"""`dgpipe bench sweep` (accuracy against steps) and `dgpipe bench serve` (Triton throughput and latency).

Both write JSON plus PNG plots next to it and return the result; every figure carries the step policy.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.results import save_result
from pipeline.demo import sudoku

SWEEP_JSON, SWEEP_PLOT = "sweep.json", "sweep.png"
SERVE_JSON, SERVE_PLOTS = "serve.json", ("serve_throughput.png", "serve_latency.png")


def _plot(path: Path, draw) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---- sweep ----------------------------------------------------------------------------------------
def run_sweep(
    model,
    bounds: list[float],
    steps: list[int],
    n: int,
    givens: tuple[int, int] | None,
    out: Path,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Solve rate per (bound, max steps) on n puzzles; writes out/sweep.json + sweep.png, returns the result.
    `progress(k)` is told of every k puzzles done (len(bounds) * len(steps) * n in all)."""
    from pipeline.demo.evaluate import eval_sudoku
    from pipeline.runtime.session import load_session

    session = load_session(model)
    givens = givens or tuple(session.checkpoint.dgpipe.get("givens_range", (45, 61)))  # type: ignore[assignment]
    puzzles = sudoku.make_dataset(30_000, n, givens)
    points: list[dict[str, Any]] = []
    for b in bounds:
        for s in steps:
            sampler = session.sampler(entropy_bound=b, max_denoising_steps=s)
            rep = eval_sudoku(session.model, puzzles, givens, sampler, batch=100, progress=progress)
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
        "n": n,
        "givens": givens,
        "policy": "adaptive (confidence 0.005)",
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
        ax.set_ylabel(f"solve rate, % of {n} puzzles ({givens[0]}-{givens[1]} givens)")
        ax.set_title("Entropy bound x max steps (adaptive stop)")
        ax.legend(fontsize=8)

    _plot(out / SWEEP_PLOT, draw)
    save_result(out, SWEEP_JSON, result)
    return result


def pareto_front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on both fewer mean steps and a higher solve rate."""
    front = []
    for p in sorted(points, key=lambda p: (p["mean_steps"], -p["solve_rate"])):
        if not front or p["solve_rate"] > front[-1]["solve_rate"]:
            front.append(p)
    return front


# ---- serve ----------------------------------------------------------------------------------------
def _timed_request(url: str, puzzle: str, seed: int) -> dict[str, float]:
    from pipeline.serving.client import generate

    start = time.perf_counter()
    first = None
    gen = generate(url, puzzle, max_tokens=82, stream=True, seed=seed, exclude_input_in_output=True)
    text = ""
    try:
        while True:
            piece = next(gen)
            first = first if first is not None else time.perf_counter() - start
            text += piece
    except StopIteration:
        pass
    total = time.perf_counter() - start
    return {
        "latency": total,
        "ttfc": first if first is not None else total,
        "tokens": 82.0,
        "ok": float(len(text) == 81),
    }


def _in_process(session, puzzles: list[str], concurrency: int) -> list[dict[str, float]]:
    """The same requests through the runtime directly: all submitted, `concurrency` slots, each freed slot
    refilled at the next canvas boundary (as the server does). Latency counts from admission, like a
    closed-loop client that sends its next request when the previous one returns."""
    import torch

    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    rt = BlockDiffusionRuntime(session.model, max_batch=concurrency, max_len=400)
    reqs = [
        Request(
            prompt_ids=session.encode_prompt(p),
            max_tokens=82,
            sampler=session.sampler(),
            seed=i,
            draw_id=0,
            template=session.default_template(p),
        )
        for i, p in enumerate(puzzles)
    ]
    with torch.inference_mode():
        results = rt.generate(reqs)
    return [
        {
            "latency": r.finished - r.admitted,
            "ttfc": r.time_to_first_canvas - (r.admitted - r.started),
            "tokens": float(len(r.tokens)),
            "ok": 1.0,
        }
        for r in results
    ]


def _summary(samples: list[dict[str, float]], wall: float) -> dict[str, float]:
    lat = [s["latency"] for s in samples]
    return {
        "requests": len(samples),
        "requests_per_s": len(samples) / wall,
        "tokens_per_s": sum(s["tokens"] for s in samples) / wall,
        "p50_ms": 1000 * percentile(lat, 0.5),
        "p90_ms": 1000 * percentile(lat, 0.9),
        "p99_ms": 1000 * percentile(lat, 0.99),
        "ttfc_p50_ms": 1000 * statistics.median(s["ttfc"] for s in samples),
        "ok_rate": sum(s["ok"] for s in samples) / len(samples),
    }


def run_bench_serve(
    http_url: str | None,
    grpc_url: str | None,
    concurrency: list[int],
    requests: int,
    out: Path,
) -> dict[str, Any]:
    """Closed-loop clients at each concurrency over HTTP and gRPC, and the same requests in-process;
    writes out/serve.json + two plots, returns the result."""
    from pipeline.runtime.session import load_session

    session = load_session()
    lo, hi = session.checkpoint.dgpipe.get("givens_range", (45, 61))
    puzzles = [p for p, _ in sudoku.make_dataset(40_000, requests, (lo, hi))]
    rows = []
    targets = [("http", http_url), ("grpc", grpc_url)]
    for c in concurrency:
        for proto, url in targets:
            if not url:
                continue
            _timed_request(url, puzzles[0], 0)  # warm the connection path
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(c) as pool:
                samples = list(
                    pool.map(lambda ip, u=url: _timed_request(u, ip[1], ip[0]), enumerate(puzzles))
                )
            rows.append(
                {"protocol": proto, "concurrency": c, **_summary(samples, time.perf_counter() - start)}
            )
        start = time.perf_counter()
        samples = _in_process(session, puzzles, c)
        rows.append(
            {"protocol": "in-process", "concurrency": c, **_summary(samples, time.perf_counter() - start)}
        )
    result = {
        "http": http_url,
        "grpc": grpc_url,
        "requests_per_level": requests,
        "policy": "adaptive <= 48 (defaults)",
        "model": str(session.checkpoint.path),
        "rows": rows,
    }

    def draw_metric(key: str, label: str):
        def draw(ax) -> None:
            for proto in ("in-process", "http", "grpc"):
                pts = [r for r in rows if r["protocol"] == proto]
                if pts:
                    ax.plot([r["concurrency"] for r in pts], [r[key] for r in pts], "o-", label=proto)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.set_title(f"Sudoku model via Triton: {label}")
            ax.legend()

        return draw

    _plot(out / SERVE_PLOTS[0], draw_metric("tokens_per_s", "tokens/s"))
    _plot(out / SERVE_PLOTS[1], draw_metric("p50_ms", "p50 latency (ms)"))
    save_result(out, SERVE_JSON, result)
    return result
