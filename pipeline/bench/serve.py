"""`dgpipe bench serve`: throughput and latency of a Triton server at several concurrencies, against the
same runtime in-process, as JSON plus PNG plots; every figure carries the step policy."""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.bench.local import policy_name
from pipeline.bench.machine import machine
from pipeline.bench.results import percentile, save_plot, save_result
from pipeline.bench.workload import BenchRequest, bench_requests
from pipeline.limits import context_length

if TYPE_CHECKING:
    from pipeline.serving.server import TritonServer

SERVE_JSON, SERVE_PLOTS = "serve.json", ("serve_throughput.png", "serve_latency.png")
REQUEST_SEED = 40_000  # the held-out examples the serving benchmarks send (apart from other evaluations')


def _timed_request(url: str, req: BenchRequest, seed: int) -> dict[str, float]:
    """One streamed request: latency, time to the first canvas, and `ok` when the reply is a full answer
    (as long as the reference one, right or not)."""
    from pipeline.serving.client import generate

    start = time.perf_counter()
    first = None
    gen = generate(
        url,
        req.prompt,
        max_tokens=req.max_tokens,
        stream=True,
        seed=seed,
        exclude_input_in_output=True,
        return_num_output_tokens=True,
    )
    text, reply = "", None
    try:
        while True:
            piece = next(gen)
            first = first if first is not None else time.perf_counter() - start
            text += piece
    except StopIteration as done:
        reply = done.value
    total = time.perf_counter() - start
    delivered = reply.num_output_tokens if reply is not None else None
    return {
        "latency": total,
        "ttfc": first if first is not None else total,
        "tokens": float(delivered if delivered is not None else 0),  # delivered, as in-process counts them
        "ok": float(len(text) == req.answer_chars),
    }


def _in_process(session, requests: list[BenchRequest], concurrency: int) -> list[dict[str, float]]:
    """The same requests through the runtime directly: all submitted, `concurrency` slots, each freed slot
    refilled at the next canvas boundary (as the server does). Latency counts from admission, like a
    closed-loop client that sends its next request when the previous one returns."""
    import torch

    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    prompts = [session.encode_prompt(r.prompt) for r in requests]
    length = session.model.config.canvas_length
    longest = max(context_length(len(p), r.max_tokens, length) for p, r in zip(prompts, requests))
    rt = BlockDiffusionRuntime(session.model, max_batch=concurrency, max_len=longest)
    reqs = [
        Request(
            prompt_ids=prompts[i],
            max_tokens=r.max_tokens,
            sampler=session.sampler(),
            seed=i,
            draw_id=0,
            template=session.default_template(r.prompt),
        )
        for i, r in enumerate(requests)
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
    reqs = bench_requests(session, requests, REQUEST_SEED, "`dgpipe bench serve`")
    rows = []
    targets = [("http", http_url), ("grpc", grpc_url)]
    for c in concurrency:
        for proto, url in targets:
            if not url:
                continue
            _timed_request(url, reqs[0], 0)  # warm the connection path
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(c) as pool:
                samples = list(pool.map(lambda ir, u=url: _timed_request(u, ir[1], ir[0]), enumerate(reqs)))
            rows.append(
                {"protocol": proto, "concurrency": c, **_summary(samples, time.perf_counter() - start)}
            )
        _in_process(session, reqs[:1], 1)  # warm up, as each protocol's first request does
        start = time.perf_counter()
        samples = _in_process(session, reqs, c)
        rows.append(
            {"protocol": "in-process", "concurrency": c, **_summary(samples, time.perf_counter() - start)}
        )
    result = {
        "http": http_url,
        "grpc": grpc_url,
        "requests_per_level": requests,
        "policy": policy_name(session.sampler()),
        "model": str(session.checkpoint.path),
        "dtype": str(next(session.model.parameters()).dtype),
        "machine": machine(),
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
            ax.set_title(f"{session.checkpoint.path.name} via Triton: {label}")
            ax.legend()

        return draw

    save_plot(out / SERVE_PLOTS[0], draw_metric("tokens_per_s", "tokens/s"))
    save_plot(out / SERVE_PLOTS[1], draw_metric("p50_ms", "p50 latency (ms)"))
    save_result(out, SERVE_JSON, result)
    return result


def free_port() -> int:
    """A port nothing listens on now (bind-then-close: another process may still take it first)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def embedded_server(out: Path, max_batch: int) -> Iterator[TritonServer]:
    """tritonserver on the embedded model, packaged under out/model_repository with `max_batch`, on free
    local ports, stopped on exit: what a benchmark measures when not pointed at a running server."""
    from pipeline.limits import Limits
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package
    from pipeline.serving.server import Ports, TritonServer

    repo = package(default_model_path(), out / "model_repository", limits=Limits(max_batch=max_batch))
    with TritonServer(
        repo, Ports(free_port(), free_port(), free_port(), "127.0.0.1"), out / "server"
    ) as server:
        yield server


def bench_serve(
    http_url: str | None, grpc_url: str | None, concurrency: list[int], requests: int, out: Path
) -> dict[str, Any]:
    """`run_bench_serve` against the server at `http_url` (and `grpc_url`), or against one started here
    on the embedded model when no URL is given."""
    if http_url:
        return run_bench_serve(http_url, grpc_url, concurrency, requests, out)
    with embedded_server(out, max(concurrency)) as server:
        return run_bench_serve(server.http_url, server.grpc_url, concurrency, requests, out)


def render(result: dict) -> list[str]:
    """The `dgpipe bench serve` table: one line per protocol and concurrency."""
    header = (
        f"{'protocol':<11}{'conc':>5}{'req/s':>8}{'tok/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
        f"{'TTFC ms':>9}{'ok':>6}"
    )
    return [header] + [
        f"{r['protocol']:<11}{r['concurrency']:>5}{r['requests_per_s']:>8.2f}{r['tokens_per_s']:>9.1f}"
        f"{r['p50_ms']:>9.1f}{r['p90_ms']:>9.1f}{r['p99_ms']:>9.1f}{r['ttfc_p50_ms']:>9.1f}{100 * r['ok_rate']:>5.0f}%"
        for r in result["rows"]
    ]
