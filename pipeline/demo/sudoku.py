"""9x9 Sudoku: fast bitmask solver, unique-solution generator, symmetry augmentation, text helpers.

Pure Python + numpy (no torch) so that data generation and scoring can run anywhere, including
dataloader workers. Grids are 81-character strings in row-major order with '.' for blanks, or
sequences of 81 ints with 0 for blanks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

__all__ = [
    "PuzzleError",
    "PuzzleFormatError",
    "augment",
    "augment_batch",
    "constraint_valid",
    "count_solutions",
    "format_grid",
    "generate_puzzle",
    "is_valid_solution",
    "make_dataset",
    "parse_puzzle",
    "random_solution",
    "solve",
]

Grid = str | Sequence[int]

# Precomputed cell -> row/column/box index, popcounts and bit -> digit lists: the search's inner loop
# then does only list lookups and integer bit operations, which is what keeps pure Python fast enough.
_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_FULL = 0x1FF
_POP = [bin(m).count("1") for m in range(512)]
_BITS = [tuple((1 << k, k + 1) for k in range(9) if m >> k & 1) for m in range(512)]
_UNITS = (
    ("row", [[r * 9 + c for c in range(9)] for r in range(9)]),
    ("column", [[r * 9 + c for r in range(9)] for c in range(9)]),
    ("box", [[i for i in range(81) if _BOX[i] == b] for b in range(9)]),
)

# the givens band the embedded model is trained and evaluated on (inclusive); a checkpoint's dgpipe.json
# `givens_range` overrides it
DEFAULT_GIVENS = (45, 61)

# make_dataset(2026, 1, (50, 50)): 50 givens, unique solution; the README, demo and benchmark puzzle
EXAMPLE_PUZZLE = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"


class PuzzleError(ValueError):
    """Raised for malformed puzzle text; the message is one line meant to be shown to a user."""


class PuzzleFormatError(PuzzleError):
    """The text is not a grid at all (wrong length or characters), as opposed to a grid whose givens
    contradict each other: callers can then say what a puzzle looks like."""


# ----------------------------------------------------------------------------------------------- text


def _clean(text: str) -> str:
    """Strip whitespace and validate characters/length, without checking Sudoku rules."""
    s = "".join(text.split())
    for pos, ch in enumerate(s):
        if ch not in ".0123456789":
            where = f" (row {pos // 9 + 1}, column {pos % 9 + 1})" if pos < 81 else ""
            raise PuzzleFormatError(
                f"invalid character {ch!r} at position {pos + 1}{where}; "
                "expected digits 1-9, '.' or '0' for blanks"
            )
    if len(s) != 81:
        raise PuzzleFormatError(f"wrong length: found {len(s)} cells, expected 81")
    return s.replace("0", ".")


def _check_givens(s: str) -> None:
    for kind, units in _UNITS:
        for u, cells in enumerate(units):
            seen: dict[str, int] = {}
            for i in cells:
                d = s[i]
                if d == ".":
                    continue
                if d in seen:
                    a, b = seen[d], i
                    raise PuzzleError(
                        f"contradictory givens: digit {d} repeats in {kind} {u + 1} "
                        f"(cells r{a // 9 + 1}c{a % 9 + 1} and r{b // 9 + 1}c{b % 9 + 1})"
                    )
                seen[d] = i


def parse_puzzle(text: str) -> str:
    """Normalise user/file text to the canonical '.'-blank form, failing early with a readable reason."""
    s = _clean(text)
    _check_givens(s)
    return s


def _cells(grid: Grid) -> list[int]:
    """Accept both string and int-sequence grids so callers never have to convert."""
    if isinstance(grid, str):
        return [0 if ch == "." else ord(ch) - 48 for ch in _clean(grid)]
    cells = [int(v) for v in grid]
    if len(cells) != 81 or any(not 0 <= v <= 9 for v in cells):
        raise PuzzleError(f"grid must be 81 values in 0..9, got {len(cells)} values")
    return cells


def format_grid(s: Grid) -> str:
    """Human-readable 9x9 view with box separators, for logs and CLI output."""
    cells = _cells(s)
    lines = []
    for r in range(9):
        if r in (3, 6):
            lines.append("------+-------+------")
        row = [str(v) if v else "." for v in cells[r * 9 : r * 9 + 9]]
        lines.append(" | ".join(" ".join(row[c : c + 3]) for c in (0, 3, 6)))
    return "\n".join(lines)


def constraint_valid(candidate: Grid) -> bool:
    """True for any complete valid grid; used to score model output without reference to givens."""
    try:
        cells = _cells(candidate)
    except PuzzleError:
        return False
    if 0 in cells:
        return False
    return all(len({cells[i] for i in u}) == 9 for _, units in _UNITS for u in units)


def is_valid_solution(puzzle: Grid, candidate: Grid) -> bool:
    """A model may output a valid grid that ignores the givens; this rejects it."""
    if not constraint_valid(candidate):
        return False
    p, c = _cells(puzzle), _cells(candidate)
    return all(g == 0 or g == v for g, v in zip(p, c, strict=True))


# --------------------------------------------------------------------------------------------- solver


class _State:
    """Mutable search state; kept incremental so the generator can add/remove givens cheaply."""

    __slots__ = ("boxes", "cols", "g", "ok", "rows")

    def __init__(self, cells: list[int]) -> None:
        self.g = list(cells)
        self.rows, self.cols, self.boxes = [0] * 9, [0] * 9, [0] * 9
        self.ok = True  # False if the givens already contradict each other
        for i, v in enumerate(cells):
            if v:
                bit = 1 << (v - 1)
                r, c, b = _ROW[i], _COL[i], _BOX[i]
                if (self.rows[r] | self.cols[c] | self.boxes[b]) & bit:
                    self.ok = False
                self.rows[r] |= bit
                self.cols[c] |= bit
                self.boxes[b] |= bit

    def toggle(self, i: int, v: int) -> None:
        bit = 1 << (v - 1)
        self.rows[_ROW[i]] ^= bit
        self.cols[_COL[i]] ^= bit
        self.boxes[_BOX[i]] ^= bit

    def empties(self) -> list[int]:
        return [i for i, v in enumerate(self.g) if v == 0]


def _search(
    st: _State, empties: list[int], limit: int, out: list[list[int]], rng: random.Random | None = None
) -> int:
    """Count solutions up to `limit` by DFS on the most constrained cell; state is restored on return."""
    if not empties:
        if not out:
            out.append(list(st.g))
        return 1
    rows, cols, boxes = st.rows, st.cols, st.boxes
    best_n = 10
    for k, i in enumerate(empties):
        m = _FULL & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
        n = _POP[m]
        if n < best_n:
            if n == 0:
                return 0
            best_n, best_k, best_i, best_m = n, k, i, m
            if n == 1:
                break
    last = empties.pop()
    if best_k < len(empties):
        empties[best_k] = last
    r, c, b = _ROW[best_i], _COL[best_i], _BOX[best_i]
    choices = _BITS[best_m]
    if rng is not None:
        choices = list(choices)
        rng.shuffle(choices)
    total = 0
    g = st.g
    for bit, d in choices:
        rows[r] |= bit
        cols[c] |= bit
        boxes[b] |= bit
        g[best_i] = d
        total += _search(st, empties, limit - total, out, rng)
        rows[r] ^= bit
        cols[c] ^= bit
        boxes[b] ^= bit
        if total >= limit:
            break
    g[best_i] = 0
    if best_k < len(empties):
        empties.append(empties[best_k])
        empties[best_k] = best_i
    else:
        empties.append(best_i)
    return total


def count_solutions(grid: Grid, limit: int = 2) -> int:
    """Uniqueness checks only need to know 0, 1 or 'more', so counting stops at `limit`."""
    st = _State(_cells(grid))
    return _search(st, st.empties(), limit, []) if st.ok else 0


def solve(grid: Grid) -> str | None:
    """Return the first solution found (the only one for a proper puzzle) as 81 digits, or None."""
    st = _State(_cells(grid))
    out: list[list[int]] = []
    if st.ok:
        _search(st, st.empties(), 1, out)
    return "".join(map(str, out[0])) if out else None


def random_solution(rng: random.Random) -> str:
    """Random complete grid via randomized DFS fill; covers all grids, unlike shuffling one base pattern."""
    st = _State([0] * 81)
    out: list[list[int]] = []
    _search(st, list(range(81)), 1, out, rng)
    return "".join(map(str, out[0]))


# ------------------------------------------------------------------------------------------ generator


def _still_unique(st: _State, empties: list[int], i: int, v: int) -> bool:
    """Still unique after blanking cell i (true value v)? Only another digit at i can add a solution."""
    mask = _FULL & ~(st.rows[_ROW[i]] | st.cols[_COL[i]] | st.boxes[_BOX[i]]) & ~(1 << (v - 1))
    for _bit, d in _BITS[mask]:  # mask == 0 (naked single) is the common fast path: nothing to try
        st.g[i] = d
        st.toggle(i, d)
        found = _search(st, empties, 1, [])
        st.toggle(i, d)
        st.g[i] = 0
        if found:
            return False
    return True


def generate_puzzle(rng: random.Random, givens: int, max_attempts: int = 10_000) -> tuple[str, str]:
    """Dig holes in a random full grid while uniqueness holds.

    A cell that cannot be removed now can never be removed later (fewer givens only add solutions), so
    one pass over a random order suffices; if it ends above the target we restart with a fresh grid.
    Targets below ~22 givens are rarely reachable this way and will exhaust `max_attempts`.
    """
    if not 17 <= givens <= 81:
        raise ValueError(f"givens must be in 17..81, got {givens}")
    for _ in range(max_attempts):
        solution = random_solution(rng)
        st = _State([ord(ch) - 48 for ch in solution])
        empties: list[int] = []
        order = list(range(81))
        rng.shuffle(order)
        count = 81
        for i in order:
            if count == givens:
                break
            v = st.g[i]
            st.g[i] = 0
            st.toggle(i, v)
            if _still_unique(st, empties, i, v):
                empties.append(i)
                count -= 1
            else:
                st.g[i] = v
                st.toggle(i, v)
        if count == givens:
            return "".join(str(v) if v else "." for v in st.g), solution
    raise RuntimeError(f"could not generate a unique puzzle with {givens} givens in {max_attempts} attempts")


def make_dataset(seed: int, n: int, givens: tuple[int, int]) -> list[tuple[str, str]]:
    """Seeded so train/eval splits are reproducible; givens drawn uniformly from the inclusive range."""
    rng = random.Random(seed)
    lo, hi = givens
    return [generate_puzzle(rng, rng.randint(lo, hi)) for _ in range(n)]


# --------------------------------------------------------------------------------------- augmentation


def _perm9(rng: random.Random) -> list[int]:
    """Validity-preserving line order: shuffle the three bands, then the three lines inside each band."""
    bands = rng.sample(range(3), 3)
    return [3 * b + k for b in bands for k in rng.sample(range(3), 3)]


def augment(puzzle: str, solution: str, rng: random.Random, transpose: bool = True) -> tuple[str, str]:
    """Apply one random Sudoku symmetry to both grids, multiplying data without new solver work."""
    rows, cols = _perm9(rng), _perm9(rng)
    idx = [rows[r] * 9 + cols[c] for r in range(9) for c in range(9)]
    if transpose and rng.random() < 0.5:
        idx = [idx[c * 9 + r] for r in range(9) for c in range(9)]
    digits = rng.sample("123456789", 9)
    table = str.maketrans("1234567890", "".join(digits) + ".")
    return (
        "".join(puzzle[j] for j in idx).translate(table),
        "".join(solution[j] for j in idx).translate(table),
    )


def _perm9_batch(n: int, rng: np.random.Generator) -> np.ndarray:
    bands = rng.permuted(np.tile(np.arange(3), (n, 1)), axis=1)
    within = rng.permuted(np.tile(np.arange(3), (n, 3, 1)), axis=2)
    return (3 * bands[:, :, None] + within).reshape(n, 9)


def augment_batch(
    puzzles: np.ndarray, solutions: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised `augment` for (N, 81) int arrays (0 = blank): one independent symmetry per row."""
    n = puzzles.shape[0]
    rows, cols = _perm9_batch(n, rng), _perm9_batch(n, rng)
    idx = rows[:, :, None] * 9 + cols[:, None, :]  # (N, 9, 9) source cell for each target cell
    flip = rng.random(n) < 0.5
    idx = np.where(flip[:, None, None], idx.transpose(0, 2, 1), idx)
    idx = idx.reshape(n, 81)
    lut = np.zeros((n, 10), dtype=puzzles.dtype)
    lut[:, 1:] = rng.permuted(np.tile(np.arange(1, 10, dtype=puzzles.dtype), (n, 1)), axis=1)
    p = np.take_along_axis(lut, np.take_along_axis(puzzles, idx, axis=1).astype(np.intp), axis=1)
    s = np.take_along_axis(lut, np.take_along_axis(solutions, idx, axis=1).astype(np.intp), axis=1)
    return p.astype(puzzles.dtype, copy=False), s.astype(solutions.dtype, copy=False)
