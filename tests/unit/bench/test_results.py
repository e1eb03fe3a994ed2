"""The benchmark statistics against hand-computed values (the serve benchmark's p50/p90/p99)."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.bench.results import percentile, save_result


def test_percentile_interpolates_between_order_statistics():
    lat = [40.0, 10.0, 30.0, 20.0]  # unsorted on purpose
    # rank (n - 1) * q over the sorted values, linear between neighbours
    assert percentile(lat, 0.5) == pytest.approx(25.0)  # rank 1.5
    assert percentile(lat, 0.9) == pytest.approx(37.0)  # rank 2.7
    assert percentile(lat, 0.99) == pytest.approx(39.7)  # rank 2.97
    assert percentile(lat, 0.0) == 10.0 and percentile(lat, 1.0) == 40.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_results_are_written_as_strict_json(tmp_path):
    """A value that is no finite number (the percentile of no samples, a ratio over a failed timing) is
    written as null: the file parses where NaN is refused (jq, JavaScript), and everything else is kept."""
    result = {"p50": percentile([], 0.5), "rows": [{"ms": 1.5, "x": float("inf")}, (float("-inf"), 2)],
              "path": tmp_path, "n": 3}  # fmt: skip
    path = save_result(tmp_path, "r.json", result)

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "p50": None, "rows": [{"ms": 1.5, "x": None}, [None, 2]], "path": str(tmp_path), "n": 3
    }  # fmt: skip
