"""Confidence intervals and paired tests for solve rates: the numbers that say whether a change helped.

Two decoding arms run on the same puzzles with the same seeds are paired observations, so they are
compared with McNemar's exact test on the puzzles only one arm solved (the puzzles both or neither
solved say nothing about the difference); a single rate gets a Wilson score interval, which stays inside
[0, 1] and keeps its coverage near 0% and 100%, where the Sudoku bands live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

Z95 = 1.959963984540054  # standard normal 97.5% quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def binomial_two_sided_half(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips (the McNemar exact test's null)."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass
class McNemar:
    """Paired comparison of arm `a` with arm `b` on the same puzzles."""

    a: str
    b: str
    only_a: int  # puzzles a solved and b did not
    only_b: int
    p_value: float  # exact two-sided; 1.0 when no puzzle separates them

    def as_dict(self) -> dict:
        return asdict(self)


def mcnemar(a: str, outcomes_a: Sequence[bool], b: str, outcomes_b: Sequence[bool]) -> McNemar:
    """McNemar's exact test; the outcome lists are per puzzle, in the same order."""
    if len(outcomes_a) != len(outcomes_b):
        raise ValueError(f"paired outcomes differ in length: {len(outcomes_a)} vs {len(outcomes_b)}")
    only_a = sum(1 for x, y in zip(outcomes_a, outcomes_b, strict=True) if x and not y)
    only_b = sum(1 for x, y in zip(outcomes_a, outcomes_b, strict=True) if y and not x)
    return McNemar(a, b, only_a, only_b, binomial_two_sided_half(only_a, only_a + only_b))
