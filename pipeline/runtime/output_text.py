"""A request's output text as its canvases arrive: what may be shown so far, and where a stop word ends it.

The output is decoded as one sequence, never canvas by canvas: a tokenizer that spells a character it lacks
as byte tokens (Gemma's does) splits that character's bytes across two canvases as often as anywhere else,
and each half decoded alone is U+FFFD. Text that the next canvas may still change is held back until it
comes (or the output ends): a trailing incomplete character, and the longest tail that begins a stop word,
so that no part of a stop word is ever sent (as the OpenAI API and vLLM do). Generation ends at the first
stop word, which is cut with all after it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 character to


def ready_text(whole: str, stop_words: Sequence[str], final: bool) -> tuple[str, bool]:
    """(the part of the output text `whole` that may be shown, whether a stop word ended it): cut before the
    first stop word; otherwise, unless the output is `final`, without the tail the next canvas may change."""
    hit = min((i for w in stop_words if (i := whole.find(w)) >= 0), default=-1)
    if hit >= 0:
        return whole[:hit], True
    if final:
        return whole, False
    end = len(whole.rstrip(REPLACEMENT))
    tail = whole[:end]  # a stop word's prefix longer than the text cannot end it
    held = max(
        (k for w in stop_words for k in range(1, min(len(w), end + 1)) if tail.endswith(w[:k])), default=0
    )
    return whole[: end - held], False


def tokens_covering(decode: Callable[[list[int]], str], ids: list[int], chars: int, start: int = 0) -> int:
    """How many of `ids`, `start` at the least, the first `chars` characters of their decoding stand for: the
    fewest whose decoding reaches that long (the token a cut falls in counts, so usage matches the text),
    an incomplete character at the end not counted (it decodes to as many U+FFFD as it has bytes so far)."""
    return next(
        (k for k in range(start, len(ids)) if len(decode(ids[:k]).rstrip(REPLACEMENT)) >= chars), len(ids)
    )


class OutputText:
    """One request's output: `add` each committed canvas's tokens, `finish` when it ends; each returns the
    text newly shown. After a stop word (`stopped`), `ids` are the fewest tokens that spell the text."""

    def __init__(self, decode: Callable[[list[int]], str], stop_words: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop_words = list(stop_words)
        self.ids: list[int] = []
        self.text = ""  # shown so far
        self.stopped = False

    def add(self, tokens: Sequence[int]) -> str:
        before = len(self.ids)
        self.ids += tokens
        new = self._show(final=False)
        if self.stopped:  # the tokens after the cut are not part of the output
            del self.ids[tokens_covering(self.decode, self.ids, len(self.text), before) :]
        return new

    def finish(self) -> str:
        """The text held back until the end (none after a stop word: the output ended there)."""
        return "" if self.stopped else self._show(final=True)

    def _show(self, final: bool) -> str:
        ready, self.stopped = ready_text(self.decode(self.ids), self.stop_words, final)
        if len(ready) < len(self.text):  # what was shown is never taken back
            return ""
        new, self.text = ready[len(self.text) :], ready
        return new
