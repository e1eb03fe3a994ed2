"""The requests a serving benchmark sends: held-out examples of the served model's own prompt format, so the
benchmark measures the traffic the model was made for without knowing its task (the embedded model's
format draws Sudoku puzzles of its checkpoint's givens band)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.runtime.prompt_format import require_hooks

if TYPE_CHECKING:
    from pipeline.runtime.session import Session

HOOKS = ("evaluation_examples", "answer_ids")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int  # the reference answer's canvas length: room for one full answer
    answer_chars: int  # the reference answer's length in text: a reply this long is a full answer


def bench_requests(session: Session, n: int, seed: int, what: str) -> list[BenchRequest]:
    """`n` held-out examples drawn with `seed` as requests; `what` (the benchmark) is named when the model's
    format has no examples to draw."""
    fmt = session.prompt_format
    require_hooks(fmt, HOOKS, what, session.checkpoint.path)
    return [
        BenchRequest(ex.prompt, len(fmt.answer_ids(ex.answer)), len(ex.answer))
        for ex in fmt.evaluation_examples(n, seed)
    ]
