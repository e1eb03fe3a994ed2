"""The CPU readings `dgpipe bench serve --openai` compares: a process group's CPU seconds from /proc, with
or without its children, and the table made of a result."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("psutil")

from pipeline.bench.openai_overhead import CpuMeter, render

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_cpu_meter_counts_a_childs_cpu_only_with_descendants():
    shell = subprocess.Popen(  # a parent that waits, and its child that burns 0.3 s of CPU
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN.format(s=0.3)!r}]); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        with_children, alone = CpuMeter(shell.pid), CpuMeter(shell.pid, descendants=False)
        start_all, start_alone = with_children.seconds(), alone.seconds()
        deadline = time.monotonic() + 60
        while with_children.seconds() - start_all < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)  # the child is alive (and counted) while it burns
        assert 0.25 <= with_children.seconds() - start_all < 2.0
        assert alone.seconds() - start_alone < 0.15  # the waiting parent itself uses next to nothing
    finally:
        shell.kill()
        shell.wait()


def test_render_shows_both_protocols_and_the_ratios():
    row = {"requests_per_s": 2.0, "p50_ms": 500.0, "ttfc_p50_ms": 490.0, "cpu_ms_per_request_client": 7.0}
    result = {
        "model": "m",
        "policy": "adaptive <= 48 (defaults)",
        "requests_per_level": 32,
        "rounds": 3,
        "rows": [
            {"protocol": "grpc", "concurrency": 4, **row, "cpu_ms_per_request_triton": 100.0},
            {
                "protocol": "openai",
                "concurrency": 4,
                **row,
                "cpu_ms_per_request_triton": 101.0,
                "cpu_ms_per_request_frontend": 6.0,
            },
            {
                "protocol": "openai/grpc",
                "concurrency": 4,
                "p50_latency_ratio": 1.02,
                "ttfc_p50_ratio": 1.01,
                "frontend_cpu_over_triton": 0.06,
                "frontend_cpu_over_grpc_client": 0.86,
            },
        ],
    }
    text = "\n".join(render(result))
    assert "p50 x1.020" in text and "6.0% of Triton's" in text and "0.86x a gRPC client's" in text
    assert text.count("\n") == 4


def test_cpu_per_request_pools_every_round_before_dividing():
    """The kernel counts CPU time in 10 ms ticks: per round, one tick over 3 requests reads 3.3 ms or 0; the
    level's figure is all rounds' CPU over all their requests, and latencies stay medians of the rounds."""
    from pipeline.bench.openai_overhead import _median_rows

    rounds = [
        {"requests": 3, "p50_ms": 10.0, "cpu_s_client": 0.01},
        {"requests": 3, "p50_ms": 30.0, "cpu_s_client": 0.0},
        {"requests": 3, "p50_ms": 20.0, "cpu_s_client": 0.0},
    ]
    merged = _median_rows(rounds)
    assert merged["p50_ms"] == 20.0 and merged["requests"] == 3
    assert merged["cpu_ms_per_request_client"] == pytest.approx(10.0 / 9)
    assert not any(k.startswith("cpu_s_") for k in merged)
