"""`dgpipe bench local`: its systems measured in one interleaved run, on the embedded model."""

from __future__ import annotations

import json
import math

from pipeline.bench import local


def test_systems_take_turns_round_by_round_after_a_warm_up_round():
    calls: list[tuple[str, int]] = []

    def runner(name: str):
        def run(seed: int) -> local.Sample:
            calls.append((name, seed))
            return local.Sample(total=float(seed), tokens=1, passes=1, canvases=1, pass_seconds=0.1, ttft=0.1)

        return run

    samples = local.interleaved({"a": runner("a"), "b": runner("b")}, runs=2)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert [s.total for s in samples["a"]] == [1.0, 2.0]  # the warm-up round is not counted
    row = local.median_row("a", None, samples["a"])
    assert row.ms_total == 1500.0 and row.runs == [1000.0, 2000.0]


def test_bench_local_times_dgpipe_transformers_and_autoregressive_on_the_same_prompt(tmp_path):
    from pipeline.runtime.session import default_model_path

    result = local.run_bench_local(default_model_path(), 1, 1, True, tmp_path, "float32", "cpu")
    systems = [(r["system"], r["policy"]) for r in result["rows"]]
    assert systems == [
        ("dgpipe diffusion", "fixed 16"),
        ("transformers generate", "fixed 16"),
        ("dgpipe diffusion", "adaptive <= 48"),
        ("transformers generate", "adaptive <= 48"),
        ("dgpipe autoregressive", "-"),
    ]
    fixed, ref_fixed = result["rows"][0], result["rows"][1]
    # the same sampler on the same weights: the same passes per canvas and tokens
    assert fixed["passes_per_canvas"] == ref_fixed["passes_per_canvas"] == 16.0
    assert fixed["tokens"] == ref_fixed["tokens"] == result["max_tokens"]
    assert math.isnan(result["rows"][-1]["ms_per_canvas"])
    saved = json.loads((tmp_path / local.RESULT_FILE).read_text())  # strict JSON: no NaN
    assert saved["rows"][-1]["ms_per_canvas"] is None and saved["machine"]["threads"] >= 1
