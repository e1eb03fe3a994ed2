"""What the serving benchmarks send: held-out examples of the served model's prompt format, and a clear
refusal for a model whose format has none."""

from __future__ import annotations

import pytest

from pipeline.bench.workload import bench_requests
from pipeline.errors import DgpipeError
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime.prompt_format import TextFormat
from pipeline.runtime.session import load_session


@pytest.fixture(scope="module")
def session():
    return load_session(EMBEDDED_MODEL, "float32", "cpu")


def test_requests_are_the_formats_held_out_examples_with_room_for_a_full_answer(session):
    fmt = session.prompt_format
    reqs = bench_requests(session, 3, 40_000, "bench")
    examples = fmt.evaluation_examples(3, 40_000)
    assert [r.prompt for r in reqs] == [e.prompt for e in examples]
    for r, e in zip(reqs, examples, strict=True):
        # the embedded model's answer: 81 digits as text, 81 digits + the end token on the canvas
        assert (r.answer_chars, r.max_tokens) == (len(e.answer), len(fmt.answer_ids(e.answer))) == (81, 82)
        session.encode_prompt(r.prompt)  # a prompt the model takes
    assert bench_requests(session, 3, 40_000, "bench") == reqs
    assert [r.prompt for r in bench_requests(session, 3, 40_001, "bench")] != [r.prompt for r in reqs]


def test_a_format_without_examples_is_refused_naming_the_missing_hooks(session):
    text = load_session(EMBEDDED_MODEL, "float32", "cpu")
    text.prompt_format = TextFormat(text.checkpoint, text.tokenizer)
    with pytest.raises(DgpipeError, match="TextFormat has no evaluation_examples, answer_ids") as e:
        bench_requests(text, 2, 0, "`dgpipe bench serve`")
    where, problem = str(e.value).split(": ", 1)
    assert (
        where == str(EMBEDDED_MODEL) and "`dgpipe bench serve` needs a prompt format that supplies" in problem
    )
    assert "sudoku" not in problem.lower()  # the capability is named, not the task
