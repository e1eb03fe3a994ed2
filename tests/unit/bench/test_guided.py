"""`dgpipe bench guided` runs both sides on the same requests and records what BENCHMARKS.md quotes."""

from __future__ import annotations

import json


def test_bench_guided_measures_both_sides_and_every_guided_grid_is_valid(tmp_path):
    from pipeline.bench.guided import RESULT_FILE, run_bench_guided

    result = run_bench_guided(tmp_path, batches=[2], runs=1, fixed_steps=2)
    assert json.loads((tmp_path / RESULT_FILE).read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert [r["policy"] for r in rows] == ["adaptive <= 48", "fixed 2"]
    for r in rows:
        assert r["valid_guided"] == 1.0  # by construction, whatever the step policy
        assert r["passes_ratio"] == r["passes_per_canvas_guided"] / r["passes_per_canvas"] > 0
        assert r["ms_total"] > 0 and r["ms_total_guided"] > 0
    assert rows[1]["passes_per_canvas"] == 2.0  # fixed steps: exactly 2 passes per canvas unconstrained
