"""`dgpipe bench prefix` on a tiny random model: both runtimes serve every request, the cache serves the
shared prompt's blocks, and the tokens agree."""

from __future__ import annotations

import json

from pipeline.bench.prefix import PLOT_FILE, RESULT_FILE, load_bench_model, run_bench_prefix


def test_bench_prefix_times_both_ways_and_finds_identical_tokens(tmp_path):
    model = load_bench_model("sudoku-tiny", None, threads=1)
    result = run_bench_prefix(
        model, system_tokens=300, question_tokens=10, requests=2, steps=(1,), out=tmp_path
    )
    (row,) = result["rows"]
    assert row["identical"] and row["steps"] == 1
    assert row["hit_rate"] == 256 / 310  # the one full block of each 310-token prompt
    assert row["ttft_on_ms"] > 0 and row["ttft_off_ms"] > 0 and row["prefill_on_ms"] > 0
    # the bound takes the cached run's prefill out of its time: above the measured ratio
    assert row["ttft_ratio_bound"] > row["ttft_ratio"]
    assert json.loads((tmp_path / RESULT_FILE).read_text())["rows"] == result["rows"]
    assert (tmp_path / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
