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


def test_grammar_costs_time_compiles_masks_and_steps_over_a_synthetic_vocabulary():
    from pipeline.bench.guided import grammar_costs, load_sample, synthetic_vocab

    assert len(synthetic_vocab(5000)) == 4998 and synthetic_vocab(5000)[2 + ord("{")] == b"{"
    rows = load_sample()[::100]  # one per set
    r = grammar_costs(rows, vocab_size=5000, steps=8)
    assert r["schemas"] == 10 and 0 <= r["refused"] < 10 and r["walk_errors"] == 0
    assert 0 < r["compile_ms_p50"] <= r["compile_ms_p95"] <= r["compile_ms_max"]
    assert 0 < r["mask_ms_p50"] <= r["mask_ms_p95"] and 0 < r["step_ms_p50"] <= r["step_ms_p95"]


def test_schema_table_counts_and_validates_per_set():
    from pipeline.bench.guided import bench_schemas, load_sample, schemas_table, synthetic_vocab

    rows = load_sample()[::200]  # five sets
    result = bench_schemas(rows, synthetic_vocab(3000), engines=("dgpipe",), walks=1)
    per = result["dgpipe"]
    assert per["all"]["schemas"] == 5 and sum(x["schemas"] for s, x in per.items() if s != "all") == 5
    assert per["all"]["walks_ended"] >= 1 and per["all"]["valid_pct"] == 100.0
    table = schemas_table({"engines": result})
    assert table.splitlines()[-1].startswith("| all | dgpipe | ") and len(table.splitlines()) == 2 + 6


def test_bench_schemas_command_writes_the_table_and_names_engines_it_could_not_measure(tmp_path):
    import importlib.util
    import json

    from tests._utils.cli import dgpipe

    args = ["--stride", "200", "--vocab-size", "1024", "--walks", "1", "--out", str(tmp_path)]
    r = dgpipe("bench", "schemas", *args, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    missing = [e for e in ("llguidance", "xgrammar") if importlib.util.find_spec(e) is None]
    assert result["not_installed"] == missing
    assert set(result["engines"]) == {"dgpipe", "llguidance", "xgrammar"} - set(missing)
    assert result["engines"]["dgpipe"]["all"]["schemas"] == 5
    assert json.loads((tmp_path / "bench_guided_schemas.json").read_text())["engines"] == result["engines"]
    text = dgpipe("bench", "schemas", *args).stdout
    assert "| all | dgpipe |" in text and (
        not missing or f"not measured (not installed): {' '.join(missing)}" in text
    )
