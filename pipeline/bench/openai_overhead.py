"""`dgpipe bench serve --openai`: what the OpenAI-compatible frontend costs over asking Triton's gRPC port
directly, in latency and in CPU per request, side by side in one run.

One tritonserver (the model, its Python-backend stub) and one frontend process (`dgpipe serve
--triton-url`, as the Kubernetes pod runs it) serve the same requests (same prompts, same seeds, so the
model does the same work) from closed-loop clients, gRPC and OpenAI alternating at each concurrency. CPU
comes from /proc via psutil for each process group: Triton (server + stub), the frontend, and this
process (the clients). The figure that matters is the frontend's CPU per request over Triton's for the
same request: what putting the OpenAI layer in front adds to serving CPU.
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.bench.machine import machine
from pipeline.bench.results import save_result
from pipeline.bench.serve import REQUEST_SEED, _summary, _timed_request
from pipeline.bench.workload import BenchRequest, bench_requests
from pipeline.errors import DgpipeError

OPENAI_JSON = "serve_openai.json"
POLICY = "adaptive <= 48 (defaults)"


class CpuMeter:
    """User + system CPU seconds of a process and, with `descendants`, of its children (those alive at each
    reading: Triton's stub processes live as long as the server)."""

    def __init__(self, pid: int, descendants: bool = True) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.descendants = descendants
        self._psutil = psutil

    def seconds(self) -> float:
        total = 0.0
        for p in [self.root, *(self.root.children(recursive=True) if self.descendants else [])]:
            try:
                t = p.cpu_times()
            except self._psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total


def start_frontend(grpc_url: str, port: int, log: Path, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`dgpipe serve --triton-url` in its own process (so its CPU is its own); returns (process, /v1 URL)."""
    cmd = [sys.executable, "-m", "pipeline.cli", "serve", "--triton-url", grpc_url]
    cmd += ["--openai-port", str(port), "--address", "127.0.0.1"]
    env = {k: v for k, v in os.environ.items() if k != "DGPIPE_API_KEY"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("ready  OpenAI "):
                return proc, line.split()[2]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise DgpipeError(f"the OpenAI frontend did not start: {log.read_text(errors='replace')[-1000:]}")


def _level(
    url: str, requests: list[BenchRequest], concurrency: int, meters: dict[str, CpuMeter]
) -> dict[str, Any]:
    """One closed-loop run: latency summary plus the CPU seconds of each process group."""
    before = {k: m.seconds() for k, m in meters.items()}
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(lambda ir: _timed_request(url, ir[1], ir[0]), enumerate(requests)))
    wall = time.perf_counter() - start
    return {**_summary(samples, wall), **{f"cpu_s_{k}": m.seconds() - before[k] for k, m in meters.items()}}


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Latencies: medians over the rounds. CPU per request: all rounds' CPU over all their requests (the
    kernel counts CPU time in clock ticks, 10 ms each: per round, 32 requests would read in 0.31 ms steps)."""
    keys = [k for k, v in rows[0].items() if isinstance(v, float | int) and not k.startswith("cpu_s_")]
    merged = {k: statistics.median(r[k] for r in rows) for k in keys}
    requests = sum(r["requests"] for r in rows)
    for k in (k for k in rows[0] if k.startswith("cpu_s_")):
        merged["cpu_ms_per_request_" + k.removeprefix("cpu_s_")] = 1000 * sum(r[k] for r in rows) / requests
    return merged


def cpu_tick_s() -> float:
    """How finely the kernel counts a process's CPU time (USER_HZ: 10 ms on Linux)."""
    return 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def run_bench_openai(
    grpc_url: str,
    openai_url: str,
    triton_pid: int,
    frontend_pid: int,
    concurrency: list[int],
    requests: int,
    rounds: int,
    out: Path,
) -> dict[str, Any]:
    """gRPC and OpenAI alternating `rounds` times at each concurrency (medians over rounds); writes
    out/serve_openai.json and returns the result."""
    from pipeline.runtime.session import load_session

    session = load_session()
    reqs = bench_requests(session, requests, REQUEST_SEED, "`dgpipe bench serve --openai`")
    triton, frontend, clients = (
        CpuMeter(triton_pid),
        CpuMeter(frontend_pid),
        CpuMeter(os.getpid(), descendants=False),  # the clients' threads; the servers are our children
    )
    for url in (grpc_url, openai_url):  # connections, imports and the frontend's threads warmed
        _timed_request(url, reqs[0], 0)
    rows = []
    for c in concurrency:
        runs: dict[str, list[dict[str, Any]]] = {"grpc": [], "openai": []}
        levels = {
            "grpc": (grpc_url, {"triton": triton, "client": clients}),
            "openai": (openai_url, {"triton": triton, "frontend": frontend, "client": clients}),
        }
        for r in range(rounds):  # each protocol first in every other round
            for name in ("grpc", "openai") if r % 2 == 0 else ("openai", "grpc"):
                url, meters = levels[name]
                runs[name].append(_level(url, reqs, c, meters))
        g, o = _median_rows(runs["grpc"]), _median_rows(runs["openai"])
        rows.append({"protocol": "grpc", "concurrency": c, **g})
        rows.append({"protocol": "openai", "concurrency": c, **o})
        rows.append(
            {
                "protocol": "openai/grpc",
                "concurrency": c,
                "p50_latency_ratio": o["p50_ms"] / g["p50_ms"],
                "ttfc_p50_ratio": o["ttfc_p50_ms"] / g["ttfc_p50_ms"],
                # the OpenAI layer's CPU per request over serving the same request by gRPC (Triton's CPU)
                "frontend_cpu_over_triton": o["cpu_ms_per_request_frontend"] / g["cpu_ms_per_request_triton"],
                # the frontend against the gRPC client work it replaces (a direct client's CPU)
                "frontend_cpu_over_grpc_client": o["cpu_ms_per_request_frontend"]
                / g["cpu_ms_per_request_client"],
                "serving_cpu_ratio": (o["cpu_ms_per_request_triton"] + o["cpu_ms_per_request_frontend"])
                / g["cpu_ms_per_request_triton"],
            }
        )
    result = {
        "grpc": grpc_url,
        "openai": openai_url,
        "requests_per_level": requests,
        "rounds": rounds,
        "policy": POLICY,
        "model": str(session.checkpoint.path),
        "cpus": os.cpu_count(),
        "machine": machine(),
        # one clock tick over every request a level sent: how finely its CPU ms per request are known
        "cpu_ms_per_request_resolution": 1000 * cpu_tick_s() / (requests * rounds),
        "rows": rows,
    }
    save_result(out, OPENAI_JSON, result)
    return result


def bench_openai(concurrency: list[int], requests: int, rounds: int, out: Path) -> dict[str, Any]:
    """tritonserver on the embedded model and a frontend process in front of it (both measured for CPU
    time), then `run_bench_openai`; both stopped after."""
    import signal

    from pipeline.bench.serve import embedded_server, free_port

    with embedded_server(out, max(concurrency)) as server:
        assert server.proc is not None
        proc, openai_url = start_frontend(server.grpc_url, free_port(), out / "server" / "frontend.log")
        try:
            return run_bench_openai(
                server.grpc_url, openai_url, server.proc.pid, proc.pid, concurrency, requests, rounds, out
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except Exception:
                proc.kill()


def render(result: dict[str, Any]) -> list[str]:
    head = (
        f"{result['model']}  policy {result['policy']}, {result['requests_per_level']} requests x "
        f"{result['rounds']} rounds per level (medians)\n"
        f"{'protocol':<12}{'conc':>5}{'req/s':>8}{'p50 ms':>9}{'TTFC ms':>9}{'Triton CPU':>11}"
        f"{'frontend':>9}{'client':>8}   (CPU ms per request)"
    )
    lines = [head]
    for r in result["rows"]:
        if r["protocol"] == "openai/grpc":
            lines.append(
                f"{'  ratio':<12}{r['concurrency']:>5}  p50 x{r['p50_latency_ratio']:.3f}  TTFC x{r['ttfc_p50_ratio']:.3f}"
                f"  frontend CPU = {100 * r['frontend_cpu_over_triton']:.1f}% of Triton's,"
                f" {r['frontend_cpu_over_grpc_client']:.2f}x a gRPC client's"
            )
            continue
        lines.append(
            f"{r['protocol']:<12}{r['concurrency']:>5}{r['requests_per_s']:>8.2f}{r['p50_ms']:>9.1f}"
            f"{r['ttfc_p50_ms']:>9.1f}{r['cpu_ms_per_request_triton']:>11.1f}"
            f"{r.get('cpu_ms_per_request_frontend', 0.0):>9.1f}{r['cpu_ms_per_request_client']:>8.1f}"
        )
    return lines
