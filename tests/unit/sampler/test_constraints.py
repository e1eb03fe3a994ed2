"""The constraint compiler: automata accept exactly the language, budgets are exact, refusals name the construct."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pipeline.errors import InputError
from pipeline.sampler.constraints import GuideCompiler, GuideSpec, token_bytes

END = 1


@pytest.fixture(scope="module")
def compiler():
    from tests._utils.chat import build_tokenizer

    return GuideCompiler(build_tokenizer(), 128, [END, 5])


def encode(compiler, text: str) -> list[int]:
    by_bytes = {b: i for i, b in compiler.vocab.items()}
    return [by_bytes[c.encode()] for c in text]


def test_character_vocabulary_spells_each_character(compiler):
    assert compiler.vocab[encode(compiler, "a")[0]] == b"a"
    assert 0 not in compiler.vocab and END not in compiler.vocab  # special tokens spell nothing


def test_byte_level_vocabulary_is_decoded_to_bytes():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({"<s>": 0, "Ġa": 1, "Ã©": 2, "b": 3}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    assert token_bytes(tok, 4) == {0: b"<s>", 1: b" a", 2: "é".encode(), 3: b"b"}


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GuideSpec("regex", "[1-9]{3}"), ["123", "999"], ["12", "1234", "012"]),
        (GuideSpec("choice", json.dumps(["yes", "no", "a.b"])), ["yes", "no", "a.b"], ["ye", "axb", "yesno"]),
        (
            GuideSpec(
                "json_schema",
                json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
            ),
            ['{"a":1}', '{ "a" : -20 }'],
            ['{"a":1.5}', '{"b":1}', '{"a":01}'],
        ),
    ],
)
def test_automaton_accepts_exactly_the_language(compiler, spec, good, bad):
    a = compiler.compile(spec)
    for text in good:
        assert a.accepts([*encode(compiler, text), END]), text
    for text in bad:
        assert not a.accepts([*encode(compiler, text), END]), text


def test_distances_are_the_shortest_completion(compiler):
    a = compiler.compile(GuideSpec("regex", "ab{2,5}c|d"))
    assert a.min_tokens == 2  # "d" + end
    state = a.next_state(0, encode(compiler, "a")[0])
    assert a.distance[state] == 3  # "bbc"


def test_allowed_respects_the_budget(compiler):
    a = compiler.compile(GuideSpec("regex", "x{1,4}"))
    x = encode(compiler, "x")[0]
    assert a.allowed(0, 2).tolist() == [x]  # "x" then the end token
    assert a.allowed(0, 1).size == 0  # one token left: cannot fit "x" and an end token
    s = a.next_state(0, x)
    assert a.allowed(s, 1).tolist() == [END, 5]  # only an end token fits
    assert a.allowed(s, 5).tolist() == [END, 5, x]
    assert set(a.loose.tolist()) == {END, 5, x}


def test_forced_takes_the_token_nearest_to_acceptance(compiler):
    """When no sampled token fits a position, the guide forces one: the token whose next state is nearest
    to acceptance ("d", which completes "ab{2,5}c|d" at once, not "a", which needs three more), so a row
    short on budget still ends valid; in an accepting state it is the end token."""
    a = compiler.compile(GuideSpec("regex", "ab{2,5}c|d"))
    (d,) = encode(compiler, "d")
    assert a.forced(0, 2) == d
    s = a.next_state(0, d)
    assert a.is_final(s) and a.forced(s, 1) == END
    # after "a", only "b" leads on: forced is the one token of the state
    assert a.forced(a.next_state(0, encode(compiler, "a")[0]), 4) == encode(compiler, "b")[0]


def test_token_ids_past_the_models_vocabulary_never_enter_a_guide():
    """A tokenizer may list more tokens than the model's embedding has rows (tokens added after training): a
    guide that allowed an id >= vocab_size would index past the logits, so such an id spells nothing here,
    the id equal to vocab_size included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({"<s>": 0, "Ġa": 1, "Ã©": 2, "b": 3, "c": 4}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    assert token_bytes(tok, 5) == {0: b"<s>", 1: b" a", 2: "é".encode(), 3: b"b", 4: b"c"}
    assert token_bytes(tok, 4) == {0: b"<s>", 1: b" a", 2: "é".encode(), 3: b"b"}


def test_compiles_are_cached(compiler):
    spec = GuideSpec("regex", "[ab]+")
    assert compiler.compile(spec) is compiler.compile(GuideSpec("regex", "[ab]+"))


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (
            GuideSpec(
                "json_schema", json.dumps({"type": "object", "properties": {"t": {"uniqueItems": True}}})
            ),
            "'uniqueItems' at #/properties/t",
        ),
        (GuideSpec("json_schema", json.dumps({"properties": {"a": {"not": {}}}})), "'not' at #/properties/a"),
        (
            GuideSpec("json_schema", json.dumps({"items": {"oneOf": [{"type": "integer"}, {"minimum": 3}]}})),
            "'oneOf' at #/items: its branches may overlap",
        ),
        (GuideSpec("json_schema", json.dumps({"type": "string", "pattern": "[a-"})), "pattern at #"),
        (GuideSpec("lark_grammar", "start: undefined_rule"), "Lark grammar cannot be compiled"),
        (GuideSpec("json_schema", "{not json"), "not valid JSON"),
        (GuideSpec("regex", "(unclosed"), "does not compile"),
        (GuideSpec("choice", "[]"), "non-empty list"),
        (GuideSpec("choice", json.dumps(["yes", ""])), "non-empty list of non-empty strings"),
        (GuideSpec("ebnf_grammar", "root ::= x"), "EBNF grammars are not supported"),
        (GuideSpec("xml", "x"), "unknown"),
        (GuideSpec("regex", "é+"), "cannot be compiled over this tokenizer"),  # no é in the vocabulary
    ],
)
def test_refusals_name_the_construct(compiler, spec, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        compiler.compile(spec)


def test_allowed_sets_are_sorted_unique(compiler):
    a = compiler.compile(GuideSpec("json", ""))
    for state in range(min(20, a.n_states)):
        toks = a.allowed(state, 100)
        assert np.array_equal(toks, np.unique(toks))


HONOURED = [
    ({"type": "integer", "minimum": 3, "maximum": 12}, ["3", "12"], ["2", "13", "-4"]),
    (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        ['{"x1":1}', "{}"],
        ['{"x1":"a"}', '{"y":1}'],
    ),
    ({"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}}, ['{"a":1}'], ["{}", '{"a":"x"}']),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"a"'], ["true"]),  # disjoint branches
    # annotations, unknown keywords and unknown formats are ignored, as JSON Schema says
    ({"type": "string", "format": "x-colour", "x-kubernetes-int-or-string": True, "example": "a"}, ['"a"'], ["1"]),
    (
        {"type": "object", "properties": {"a": {}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        ['{"a":"x","b":1}', '{"a":[],"b":2}'],
        ['{"a":"],","b":1', '{"b":1}'],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "good", "bad"), HONOURED)
def test_validation_keywords_are_honoured(compiler, schema, good, bad):
    """The guide accepts exactly what jsonschema accepts on these samples (keywords the old regex compiler
    refused or mis-compiled)."""
    import jsonschema

    a = compiler.compile(GuideSpec("json_schema", json.dumps(schema)))
    for text in good:
        jsonschema.validate(json.loads(text), schema)
        assert a.accepts([*encode(compiler, text), END]), text
    for text in bad:
        assert not a.accepts([*encode(compiler, text), END]), text


def test_lark_grammars_compile(compiler):
    a = compiler.compile(GuideSpec("lark_grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'))
    assert a.accepts([*encode(compiler, "(1,23)"), END])
    assert not a.accepts([*encode(compiler, "(1,)"), END])
    assert a.min_tokens == 4  # "(0)" + end


def test_checks_need_no_tokenizer():
    GuideSpec("json_schema", json.dumps({"type": "integer", "minimum": 0})).check()
    with pytest.raises(InputError, match="'if' at #/properties/p"):
        GuideSpec("json_schema", json.dumps({"properties": {"p": {"if": {}, "then": {}}}})).check()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "dependencies": {"a": ["b"]}},
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}, "dependentSchemas": {"a": {"required": ["b"]}}},
    ],
)  # fmt: skip
def test_dependencies_are_honoured(compiler, schema):
    a = compiler.compile(GuideSpec("json_schema", json.dumps(schema)))
    for text, ok in [("{}", True), ('{"a":1,"b":2}', True), ('{"b":2}', True), ('{"a":1}', False)]:
        assert a.accepts([*encode(compiler, text), END]) == ok, text
