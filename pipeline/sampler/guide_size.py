"""Size checks on a guide before anything compiles it: its bytes (`max_guide_bytes`) and, for a regex, its
positions once counted repeats are expanded (`max_regex_positions`). A regex's token automaton grows with
its expanded positions (`[1-9]{50000}` is 50,000 chained states, ~29 s of compile in the model's process
before this check), so counting them first answers an oversized regex in microseconds. Stdlib only: the
OpenAI frontend runs the same checks before it forwards a request."""

from __future__ import annotations

import re

from pipeline.errors import InputError

try:  # Python 3.11+: the regex parser the `re` module itself uses
    from re import _constants as _sre_constants  # type: ignore[attr-defined]
    from re import _parser as _sre_parser  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _sre_constants  # type: ignore[no-redef]
    import sre_parse as _sre_parser  # type: ignore[no-redef]

_REPEATS = (
    _sre_constants.MAX_REPEAT,
    _sre_constants.MIN_REPEAT,
    getattr(_sre_constants, "POSSESSIVE_REPEAT", None),
)


def regex_positions(pattern: str, cap: int) -> int:
    """The positions of `pattern` with each counted repeat expanded (`a{3}` is 3, `(ab|c){2,5}` is 15, `a*`
    is 1), counted up to just past `cap` (so a nested repeat cannot make the count itself expensive).
    Raises re.error when the pattern does not parse."""
    return _count(_sre_parser.parse(pattern), cap)


def _count(items, cap: int) -> int:
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            low, high, sub = arg
            times = low if high == _sre_constants.MAXREPEAT else high
            total += _count(sub, cap) * max(times, 1)
        elif op is _sre_constants.SUBPATTERN:
            total += _count(arg[-1], cap)
        elif op is _sre_constants.BRANCH:
            total += sum(_count(branch, cap) for branch in arg[1])
        elif op in (_sre_constants.ASSERT, _sre_constants.ASSERT_NOT):
            total += _count(arg[1], cap)
        elif getattr(_sre_constants, "ATOMIC_GROUP", None) is op:
            total += _count(arg, cap)
        elif op is _sre_constants.GROUPREF_EXISTS:
            total += sum(_count(b, cap) for b in arg[1:] if b is not None)
        else:
            total += 1
        if total > cap:
            return total
    return total


def check_guide_size(kind: str, guide: str, max_bytes: int, max_positions: int, where: str = "guide") -> None:
    """Refuse a guide over the server's size limits (InputError naming the limit): before it is compiled."""
    size = len(guide.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InputError(
            f"{where} is {size} bytes, over this server's limit of {max_bytes} bytes (max_guide_bytes)",
            "send a smaller schema, regex or grammar",
        )
    if kind != "regex":
        return
    try:
        positions = regex_positions(guide, max_positions)
    except (re.error, RecursionError, OverflowError):
        return  # the compiler names what is wrong with it
    if positions > max_positions:
        raise InputError(
            f"{where}: the regex expands to more than {max_positions} positions (max_regex_positions) once "
            "its counted repeats are unrolled and its alternatives laid side by side",
            "use smaller repeat counts ({n}), an unbounded repeat (+, *), or fewer or shorter alternatives (|)",
        )
