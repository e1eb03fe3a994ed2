"""Wilson intervals and McNemar's exact test against scipy (the oracle) and published values."""

from __future__ import annotations

import pytest

from pipeline.demo.stats import mcnemar, wilson_interval


def test_wilson_interval_matches_scipy_and_stays_in_unit_range():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(254, 300), (858, 1000), (0, 50), (50, 50), (7, 24), (1, 1)]:
        ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        lo, hi = wilson_interval(k, n)
        assert lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12), (k, n)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    # Wilson's interval for 0 of 10 is [0, z^2 / (n + z^2)] = [0, 0.2775]: never a zero-width interval
    assert wilson_interval(0, 10)[1] == pytest.approx(0.27753, abs=1e-5)


def test_mcnemar_exact_counts_only_discordant_pairs():
    stats = pytest.importorskip("scipy.stats")
    # the measurement: 12 puzzles solved only unpinned, 2 only pinned -> p = 0.013
    a = [True] * 2 + [False] * 12 + [True] * 250 + [False] * 36
    b = [False] * 2 + [True] * 12 + [True] * 250 + [False] * 36
    t = mcnemar("pinned", a, "unpinned", b)
    assert (t.only_a, t.only_b) == (2, 12)
    assert t.p_value == pytest.approx(stats.binomtest(2, 14, 0.5).pvalue, rel=1e-12)
    assert t.p_value == pytest.approx(0.01294, abs=1e-5)
    assert mcnemar("x", [True, False], "y", [True, False]).p_value == 1.0  # nothing separates them
    assert mcnemar("x", [True] * 5, "y", [False] * 5).p_value == pytest.approx(2 / 32)
    with pytest.raises(ValueError, match="differ in length"):
        mcnemar("x", [True], "y", [True, False])
