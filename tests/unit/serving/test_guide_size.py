"""Guide size checks before compiling: bytes, and a regex's positions with its counted repeats unrolled."""

from __future__ import annotations

import pytest

from pipeline.errors import InputError
from pipeline.sampler.guide_size import check_guide_size, regex_positions


def test_regex_positions_count_expanded_repeats():
    assert regex_positions("[1-9]{50000}", 10_000) > 10_000
    assert regex_positions("(ab|c){2,5}", 100) == 15
    assert regex_positions("a*b+", 100) == 2
    # re folds 1|2 into one class: 1 + 1 + 16; small, its cost is its automaton's states (the time limit)
    assert regex_positions("(1|2)*1(1|2){16}", 100) == 18


def test_guides_over_a_size_limit_are_refused_naming_it():
    with pytest.raises(
        InputError, match=r"11 bytes, over this server's limit of 10 bytes \(max_guide_bytes\)"
    ):
        check_guide_size("json_schema", "x" * 11, 10, 100)
    with pytest.raises(InputError, match=r"more than 10000 positions \(max_regex_positions\)"):
        check_guide_size("regex", "[1-9]{50000}", 1 << 20, 10_000)
    check_guide_size("regex", "[1-9]{81}", 1 << 20, 10_000)
    check_guide_size(
        "regex", "([unclosed", 1 << 20, 10
    )  # a regex that does not parse is the compiler's to name
