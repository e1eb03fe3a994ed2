"""Constrained denoising end to end: on a random transformers-written model (so validity can only come from
the constraint) every output of 500 seeded generations over 25 guides parses and validates; batching does
not change a constrained output; the Sudoku model under a digits regex gives clean grids."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from pipeline.runtime.session import load_session

SEEDS = 20
OBJ = {"type": "object"}
SCHEMAS = [
    {**OBJ, "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"enum": ["red", "green", "blue"]},
    {"type": "boolean"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {**OBJ, "properties": {"point": {**OBJ, "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}, "required": ["point"]},
    {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    {**OBJ, "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["lo", "hi"]}}, "required": ["ok", "level"]},
    {"const": "fixed"},
    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    {"type": "string", "pattern": "^[a-z]{2,4}$"},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "array", "items": {**OBJ, "properties": {"id": {"type": "integer"}}, "required": ["id"]}, "maxItems": 2},
    {"type": "null"},
    {"$defs": {"tag": {"enum": ["x", "y"]}}, **OBJ, "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}}, "required": ["tags"]},
]  # fmt: skip
REGEXES = [r"[1-9]{5}", r"(yes|no)", r"[a-z]+@[a-z]+\.com", r"\d{3}-\d{4}", r"(ab)*c"]
CHOICES = [["alpha", "beta", "gamma"], ["x", "xy", "xyz"]]
GUIDES = (
    [("json_schema", json.dumps(s)) for s in SCHEMAS]
    + [("regex", r) for r in REGEXES]
    + [("choice", json.dumps(c)) for c in CHOICES]
    + [("json", "")]
)


def check(kind: str, guide: str, text: str) -> None:
    """The oracle: jsonschema for schemas, re.fullmatch for regexes, membership for choices."""
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(guide))
    elif kind == "json":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(guide, text), (guide, text)
    else:
        assert text in json.loads(guide), text


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from tests._utils.chat import write_chat_checkpoint

    return load_session(write_chat_checkpoint(tmp_path_factory.mktemp("chat")), device="cpu")


def requests(session, kind, guide, seeds, max_tokens=96, **kw):
    automaton = session.compile_guide(kind, guide)
    ids = session.encode_prompt("Answer:")
    return [
        Request(
            ids, max_tokens=max_tokens, sampler=session.sampler(), seed=s, request_id=s, guide=automaton, **kw
        )
        for s in seeds
    ]


@pytest.mark.slow  # 500 generations: ~40 s on 2 cores
def test_every_constrained_output_validates(session):
    assert len(GUIDES) >= 25 and len(GUIDES) * SEEDS >= 500
    rt = BlockDiffusionRuntime(session.model, max_batch=SEEDS)
    total, multi_canvas = 0, 0
    for kind, guide in GUIDES:
        for res in rt.generate(requests(session, kind, guide, range(SEEDS))):
            text = session.decode(res.tokens)
            assert res.finish_reason == "stop" and res.tokens[-1] in session.end_token_ids, (guide, text)
            check(kind, guide, text)
            total += 1
            multi_canvas += len(res.steps_per_canvas) > 1
    assert total == len(GUIDES) * SEEDS
    assert multi_canvas > 50  # the DFA state carried across canvases in many outputs


def validates(kind: str, guide: str, text: str) -> bool:
    try:
        check(kind, guide, text)
    except (AssertionError, ValueError, jsonschema.ValidationError):  # ValueError: not JSON at all
        return False
    return True


def test_unconstrained_outputs_of_the_random_model_do_not_validate(session):
    """The control: without a guide the same model's outputs satisfy none of the guides (not JSON, no regex's
    match, no choice), so the validity of the constrained outputs is the guides'."""
    rt = BlockDiffusionRuntime(session.model, max_batch=8)
    ids = session.encode_prompt("Answer:")
    out = rt.generate(
        [Request(ids, max_tokens=32, sampler=session.sampler(), seed=s, request_id=s) for s in range(8)]
    )
    texts = [session.decode(r.tokens) for r in out]
    assert all(texts), texts
    assert not [(g, t) for kind, g in GUIDES for t in texts if validates(kind, g, t)]
    guided = rt.generate(requests(session, "regex", REGEXES[0], range(8), max_tokens=32))
    assert all(validates("regex", REGEXES[0], session.decode(r.tokens)) for r in guided)


def test_batching_does_not_change_a_constrained_output(session):
    kind, guide = "json_schema", json.dumps(SCHEMAS[0])
    alone = BlockDiffusionRuntime(session.model, max_batch=1).generate(requests(session, kind, guide, [7]))
    mixed = [
        *requests(session, "regex", r"[a-z]+@[a-z]+\.com", [1, 2]),
        Request(
            session.encode_prompt("Other prompt"),
            max_tokens=40,
            sampler=session.sampler(),
            seed=3,
            request_id=3,
        ),
        *requests(session, kind, guide, [7]),
    ]
    batched = BlockDiffusionRuntime(session.model, max_batch=4).generate(mixed)
    assert batched[3].tokens == alone[0].tokens
    assert batched[3].steps_per_canvas == alone[0].steps_per_canvas


def test_budget_too_small_for_the_guide_is_refused(session):
    from pipeline.errors import InputError

    rt = BlockDiffusionRuntime(session.model, max_batch=1)
    with pytest.raises(InputError, match="needs at least 6 tokens"):
        rt.submit(requests(session, "regex", "[1-9]{5}", [0], max_tokens=5)[0])


def test_outputs_end_within_max_tokens(session):
    rt = BlockDiffusionRuntime(session.model, max_batch=4)
    for res in rt.generate(requests(session, "regex", r"[a-z]+", range(4), max_tokens=20)):
        assert len(res.tokens) <= 20 and res.finish_reason == "stop"
        assert re.fullmatch("[a-z]+", session.decode(res.tokens))


def test_a_guided_output_ends_where_its_guide_does_whatever_min_tokens_asks(session):
    """min_tokens (and ignore_eos, which load tools send) holds end tokens back; a guide whose language
    admits nothing after its end cannot go on, so the output ends there: alone, beside another guided row,
    and beside an unguided row whose min_tokens still holds."""
    rt = BlockDiffusionRuntime(session.model, max_batch=3)
    budget = 3 * rt.canvas_length
    alone = rt.generate(requests(session, "regex", "(yes|no)", [0], budget, min_tokens=budget))
    together = rt.generate(
        [
            *requests(session, "regex", "(yes|no)", [1], budget, min_tokens=budget),
            *requests(session, "regex", "[a-z]+", [2], budget),
            Request(session.encode_prompt("Answer:"), max_tokens=40, min_tokens=40, sampler=session.sampler(), seed=3),
        ]
    )  # fmt: skip
    for res in (*alone, *together[:2]):
        assert res.finish_reason == "stop" and res.tokens[-1] in session.end_token_ids, res
        assert re.fullmatch("(yes|no)|[a-z]+", session.decode(res.tokens)), session.decode(res.tokens)
    assert len(together[2].tokens) == 40 and together[2].finish_reason == "length"


def test_sudoku_model_under_a_digits_regex_gives_clean_grids():
    from pipeline.demo import sudoku

    s = load_session()
    automaton = s.compile_guide("regex", "[1-9]{81}")
    rt = BlockDiffusionRuntime(s.model, max_batch=4)
    puzzles = [p for p, _ in sudoku.make_dataset(4242, 4, tuple(s.checkpoint.dgpipe["givens_range"]))]
    reqs = [
        Request(
            s.encode_prompt(p), max_tokens=82, sampler=s.sampler(), seed=i, request_id=i,
            template=s.default_template(p), guide=automaton,
        )
        for i, p in enumerate(puzzles)
    ]  # fmt: skip
    for p, res in zip(puzzles, rt.generate(reqs), strict=True):
        grid = s.decode(res.tokens)
        assert re.fullmatch("[1-9]{81}", grid), grid
        assert all(g == "." or g == c for g, c in zip(p, grid, strict=True))  # givens kept


def test_a_guide_the_vocabulary_cannot_finish_is_refused_or_fails_its_row_alone(session):
    """Over an ASCII vocabulary, `start: "ab" "é"` cannot be finished: refused when compiled (its only
    output cannot be spelled). `start: "x" | "ab" "é"` can (`x`), so it compiles; a walk that takes `a`,
    `b` is then stuck: that request alone ends with the error (reason "error"), the other seeds and a
    request batched with them are served as if alone."""
    from pipeline.errors import InputError

    with pytest.raises(InputError, match="cannot be completed with this tokenizer's tokens"):
        session.compile_guide("lark_grammar", 'start: "ab" "\u00e9"')
    seeds = range(8)
    stuck = requests(session, "lark_grammar", 'start: "x" | "ab" "\u00e9"', seeds)
    fine = requests(session, "regex", "[1-9]{5}", [4])
    alone = BlockDiffusionRuntime(session.model, max_batch=1).generate(
        requests(session, "regex", "[1-9]{5}", [4])
    )
    *grammar, good = BlockDiffusionRuntime(session.model, max_batch=9).generate([*stuck, *fine])
    failed = [r for r in grammar if r.finish_reason == "error"]
    assert failed and len(failed) < len(grammar)
    for r in failed:
        assert r.tokens == [] and r.error.startswith(
            "the guide cannot be followed over this model's vocabulary: "
        )
        assert "\n" not in r.error
    for r in grammar:
        if r.finish_reason != "error":
            assert (r.finish_reason, session.decode(r.tokens)) == ("stop", "x")
    assert (good.finish_reason, good.tokens) == ("stop", alone[0].tokens)


@pytest.mark.parametrize("where", ["advance", "finish_canvas"])
def test_a_device_failure_in_a_guided_step_fails_the_step_not_the_guide(session, monkeypatch, where):
    """The guide's host walk touches the device (masks, probabilities): the GPU running out of memory or a
    CUDA error there is the step's failure, raised for the server to answer (retry, or restart), not the
    request's guide reported as one the vocabulary cannot follow (a 400). Its rows' guide state is dropped
    with them; a queued request stays queued."""
    import torch

    from pipeline.runtime import scheduler

    real = getattr(scheduler, where)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    rt = BlockDiffusionRuntime(session.model, max_batch=1)
    first, queued = requests(session, "regex", "[1-9]{5}", [0, 1])
    rt.submit(first), rt.submit(queued)
    monkeypatch.setattr(scheduler, where, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        while rt.busy():
            rt.step()
    dropped = rt.drop_running()
    assert [r.request.request_id for r in dropped] == [0] and not rt.guide_probs
    assert all(g is None for g in rt.guides) and [r.request.request_id for r in rt.waiting] == [1]
    monkeypatch.setattr(scheduler, where, real)
    served = rt.waiting[0]
    while rt.busy():
        rt.step()
    assert served.finish_reason == "stop" and re.fullmatch("[1-9]{5}", session.decode(served.tokens))


def test_an_infill_template_is_kept_under_a_guide_where_the_guide_allows_it(session):
    """Positions an infill template pins keep their tokens under a guide, whether the guide took them during
    the passes or the canvas's end decoded them (which once ranked every later position by the model alone,
    dropping the pins); a pin the guide cannot allow there gives way to a valid token (validity wins)."""
    from tests._utils.chat import VOCAB

    tid = {t: i for i, t in enumerate(VOCAB)}
    regex = r"[a-z]+@[a-z]+\.com"
    kept = [-1, -1, tid["x"], -1, tid["@"]]
    rt = BlockDiffusionRuntime(session.model, max_batch=4)
    ok = rt.generate(requests(session, "regex", regex, range(3), max_tokens=16, template=kept))
    for res in ok:
        text = session.decode(res.tokens)
        assert res.finish_reason == "stop" and text[2] == "x" and text[4] == "@", text
        check("regex", regex, text)
    (overridden,) = rt.generate(requests(session, "regex", regex, [0], max_tokens=16, template=[tid["@"]]))
    text = session.decode(overridden.tokens)
    assert overridden.finish_reason == "stop" and text[0] != "@", text  # '@' cannot start the address
    check("regex", regex, text)


def test_a_guide_the_vocabulary_cannot_spell_is_one_short_error():
    """`response_format: json_object` on the Sudoku model's vocabulary (digits and a few specials): outlines-core
    refuses, quoting the whole compiled regex (1 kB); the error keeps its start and says what to change."""
    from pipeline.errors import InputError
    from pipeline.runtime.session import load_session

    with pytest.raises(InputError, match="json guide cannot be compiled over this tokenizer") as e:
        load_session().compile_guide("json", "")
    assert len(str(e.value)) < 350 and "change the guide" in str(e.value)
