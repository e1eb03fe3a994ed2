"""Stop words: generation ends at the first stop word in the text, which is cut there. Text streams per
canvas, so a stop word may straddle two canvases: the search runs over the text so far plus the new piece."""

from __future__ import annotations

from collections.abc import Callable


def cut_at_stop_word(text: str, piece: str, stop_words: list[str]) -> tuple[str, bool]:
    """(the part of `piece` before the first stop word in `text + piece`, whether one was found). The text
    already sent is never taken back: a stop word found there cuts the piece to nothing."""
    whole = text + piece
    hit = min((i for w in stop_words if (i := whole.find(w)) >= 0), default=-1)
    if hit < 0:
        return piece, False
    return whole[:hit][len(text) :], True


def tokens_covering(decode: Callable[[list[int]], str], tokens: list[int], chars: int) -> int:
    """How many of a canvas's `tokens` the first `chars` characters of its decoding stand for: the fewest
    whose decoding reaches that long (what a cut piece counts as, so usage matches the text returned)."""
    if chars <= 0:
        return 0
    return next((k for k in range(1, len(tokens)) if len(decode(tokens[:k])) >= chars), len(tokens))
