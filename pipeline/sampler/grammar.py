"""Context-free guides — JSON schemas and Lark grammars — compiled by llguidance, with what a diffusion canvas
needs on top of a left-to-right token mask (docs/constrained.md).

JSON schemas are compiled straight to a grammar (no schema -> regex step): llguidance implements the
validation keywords users rely on (`minimum`/`maximum`, `patternProperties`, `oneOf` with provably
disjoint branches, `$ref` chains, formats, ...) and names the ones it does not (`not`,
`uniqueItems`, `if`/`then`, ...); those are refused with the keyword and its JSON pointer, never dropped.
Annotations and unknown keywords are ignored, as JSON Schema says; so is a `format` llguidance does not know
(a format is an annotation unless a validator opts in to asserting it).

A context-free language has no finite table of distances to acceptance, so the budget is kept by a witness:
from each state the walk rolls out one concrete completion (closing tokens first) and a token is only taken
when the completion after it still fits the tokens left. The completion after the witness's own first
token is the witness's tail, so the state's allowed set is never empty while the budget holds: outputs end
with an end token before `max_tokens` whenever the first witness fits. Where the greedy rollout finds no
completion (a `format` or `pattern` it cannot spell), the walk follows the grammar alone: its output is
still valid if it ends, and one cut by `max_tokens` ends as `length`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import InputError

# whitespace between JSON tokens: at most one space, so outputs stay short on a 256-token canvas
JSON_OPTIONS = {"whitespace_pattern": "[ ]?"}
# bytes a completion prefers, most closing first: ends strings (or opens the shortest value), objects, arrays,
# groups and numbers (`,` before digits: a number must stop to let the next property come), then scalars
CLOSING_BYTES = (
    b'"}]),:0123456789tfnaelrsu'
    + bytes(range(ord("a"), ord("z") + 1))
    + b"-.TZ@/"
    + bytes(range(ord("A"), ord("Z") + 1))
)
# a rollout that took the same token this many times in a row takes another option if there is one
REPEAT_RUN = 4
STEP_MAX_ITEMS = 200_000  # llguidance's per-mask parser work limit (its default: 50k), see _limits
# rollouts longer than this are not searched: a walk whose witness is not found within it follows the
# grammar alone from there (no budget forcing: a cut output ends as `length`)
MAX_WITNESS = 512
# subschema positions (JSON Schema 2020-12 and draft 4-7), to name where an unsupported keyword sits
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SINGLES = (
    "items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip


def keyword_pointer(schema: Any, keyword: str, where: str = "#") -> str | None:
    """The JSON pointer of the first subschema that uses `keyword` (depth first), or None."""
    if not isinstance(schema, dict):
        return None
    if keyword in schema:
        return where
    for key, value in schema.items():
        subs: list[tuple[str, Any]] = []
        if key in _MAPS and isinstance(value, dict):
            subs = [(f"{where}/{key}/{_escape(k)}", v) for k, v in value.items()]
        elif key in _LISTS and isinstance(value, list):
            subs = [(f"{where}/{key}/{i}", v) for i, v in enumerate(value)]
        elif key in _SINGLES and isinstance(value, dict):
            subs = [(f"{where}/{key}", value)]
        for path, sub in subs:
            if (hit := keyword_pointer(sub, keyword, path)) is not None:
                return hit
    return None


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _without_format(schema: Any, fmt: str) -> Any:
    """The schema with every `"format": fmt` removed (an unknown format is an annotation)."""
    if isinstance(schema, dict):
        return {k: _without_format(v, fmt) for k, v in schema.items() if not (k == "format" and v == fmt)}
    if isinstance(schema, list):
        return [_without_format(v, fmt) for v in schema]
    return schema


def _map_subschemas(schema: Any, fn) -> Any:
    """`schema` with `fn` applied to each subschema below it (not to property names or other values)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            out[key] = {k: fn(v) for k, v in value.items()}
        elif key in _LISTS and isinstance(value, list):
            out[key] = [fn(v) for v in value]
        elif key in _SINGLES and isinstance(value, dict):
            out[key] = fn(value)
    return out


def with_dependencies_as_anyof(schema: Any) -> Any:
    """`dependencies` (draft 4-7), `dependentRequired` and `dependentSchemas` rewritten exactly into what
    llguidance implements: "if `name` is present then D" is "`name` absent, or `name` present and D", so
    each becomes `allOf: [{anyOf: [{properties: {name: false}}, {allOf: [{required: [name]}, D]}]}]`."""
    if not isinstance(schema, dict):
        return schema
    schema = _map_subschemas(schema, with_dependencies_as_anyof)
    rules: list[Any] = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        deps = schema.get(key)
        if not isinstance(deps, dict):
            continue
        schema = {k: v for k, v in schema.items() if k != key}
        for name, dep in deps.items():
            then = {"required": list(dep)} if isinstance(dep, list) else dep
            rules.append({"anyOf": [{"properties": {name: False}}, {"allOf": [{"required": [name]}, then]}]})
    if rules:
        schema["allOf"] = [*schema.get("allOf", []), *rules]
    return schema


def llg_tokenizer(vocab: dict[int, bytes], vocab_size: int, end_ids: Sequence[int]) -> Any:
    """An llguidance tokenizer over the byte string each token id spells (constraints.token_bytes); ids
    that spell nothing (special tokens) get llguidance's special-token spelling and never match text."""
    import llguidance

    ids = {b: i for i, b in sorted(vocab.items(), reverse=True) if i not in end_ids}
    longest = max((len(b) for b in ids), default=1)

    class _Vocab:
        def __init__(self) -> None:
            self.eos_token_id, self.bos_token_id = end_ids[0], None
            self.tokens = [vocab.get(i) or b"\xff[%d]" % i for i in range(vocab_size)]
            self.special_token_ids = [i for i in range(vocab_size) if not vocab.get(i)]

        def __call__(self, text: bytes | str) -> list[int]:
            """Greedy longest match: llguidance tokenizes grammar literals with it (a heuristic for its
            lexer; the masks stay exact whatever tokenization it picks)."""
            data = text.encode() if isinstance(text, str) else text
            out, i = [], 0
            while i < len(data):
                n = next((n for n in range(min(longest, len(data) - i), 0, -1) if data[i : i + n] in ids), 0)
                if n == 0:
                    i += 1  # a byte no token spells alone: skipped (only ever a heuristic input)
                    continue
                out.append(ids[data[i : i + n]])
                i += n
            return out

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()), eos_token=list(end_ids))


def compile_grammar(kind: str, guide: str, tokenizer: Any | None) -> Any:
    """A JSON schema (`json_schema`) or Lark grammar (`lark_grammar`) -> an llguidance matcher at the start
    of the output, or None without a tokenizer (the grammar is then only validated). Refusals raise
    InputError naming the construct."""
    import llguidance

    if kind == "lark_grammar":
        if not guide.strip():
            raise InputError("guided Lark grammar is empty", "pass a grammar with a `start` rule")
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(guide)
        except ValueError as e:  # llguidance's refusal of the text, before any compile
            raise InputError(f"guided Lark grammar cannot be read: {e}") from e
        return _matcher(grammar, tokenizer, "Lark grammar", None)
    try:
        schema = json.loads(guide)
    except ValueError as e:
        raise InputError(f"guided JSON schema is not valid JSON: {e}") from e
    if schema is False:
        raise InputError("JSON schema at # is `false`: no value can satisfy it")
    if not isinstance(schema, dict | bool):
        raise InputError(f"JSON schema at # must be an object, not {type(schema).__name__}")
    original, schema = schema, with_dependencies_as_anyof(schema)
    for _ in range(64):  # each round drops one unknown format
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema if schema is not True else {}), overrides=JSON_OPTIONS
            )
        except ValueError as e:  # llguidance's reader refuses it (e.g. nested past its recursion limit)
            raise InputError(f"guided JSON schema cannot be read: {e}") from e
        try:
            return _matcher(grammar, tokenizer, "JSON schema", original)
        except _UnknownFormat as e:
            schema = _without_format(schema, e.args[0])
    raise InputError("JSON schema uses more than 64 unknown formats")


def _limits() -> Any:
    """llguidance's per-mask work limit raised 4x (200k Earley items): over a 262k vocabulary of random
    strings a wide object with `patternProperties` exceeded the default 50k; the matcher then stops with
    an error instead of a mask."""
    import llguidance

    return llguidance.LLParserLimits(step_max_items=STEP_MAX_ITEMS)


class _UnknownFormat(Exception):
    pass


def _matcher(grammar: str, tokenizer: Any, what: str, schema: Any) -> Any:
    """The matcher (None without a tokenizer: the grammar is only validated)."""
    import llguidance

    if tokenizer is None:
        matcher, error = None, llguidance.LLMatcher.validate_grammar(grammar)
        if not error or error.startswith("WARNING"):
            return None
    else:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        if not matcher.is_error():
            return matcher
        error = matcher.get_error()
    error = error.strip()
    first = error.splitlines()[0] if error else "unknown error"
    if schema is not None:
        _refuse_schema(schema, first, error)
    raise InputError(f"{what} cannot be compiled for constrained decoding: {error}")


def _refuse_schema(schema: Any, first: str, error: str) -> None:
    """Turn llguidance's schema error into InputError naming the keyword and its JSON pointer."""
    if first.startswith("Unknown format: "):
        raise _UnknownFormat(first.removeprefix("Unknown format: "))
    keywords: list[str] = []
    if first.startswith("Unimplemented keys: "):
        try:
            keywords = json.loads(first.removeprefix("Unimplemented keys: "))
        except ValueError:
            keywords = []
    elif first.startswith("oneOf constraints are not supported"):
        where = keyword_pointer(schema, "oneOf") or "#"
        raise InputError(
            f"JSON schema keyword 'oneOf' at {where}: its branches may overlap, and an output matching two "
            "of them would be invalid, so constrained decoding cannot enforce it",
            "make the branches disjoint (different types, or a property with a different const per branch) "
            "or use anyOf",
        )
    elif first.startswith("min/maxProperties"):
        keywords = ["minProperties", "maxProperties"]
    for keyword in keywords:
        where = keyword_pointer(schema, keyword)
        if where is not None:
            raise InputError(
                f"JSON schema keyword {keyword!r} at {where} is not supported by constrained decoding"
                + ("" if first.startswith("Unimplemented") else f" ({first})"),
                "remove it, or validate that constraint after generation",
            )
    if keywords:
        raise InputError(
            f"JSON schema keywords {', '.join(keywords)} are not supported by constrained decoding"
        )
    if "pattern" in error or "regex" in first:
        where = keyword_pointer(schema, "pattern") or "#"
        raise InputError(f"JSON schema pattern at {where} cannot be compiled: {' '.join(error.split())}")
    raise InputError(f"JSON schema cannot be compiled for constrained decoding: {first}")


@dataclass
class GrammarGuide:
    """A compiled context-free guide, shared by the requests that use it (compiles are cached); each request
    walks it through its own `GrammarWalk` (`for_request`)."""

    spec: Any  # constraints.GuideSpec
    vocab_size: int
    end_ids: tuple[int, ...]
    matcher: Any  # llguidance.LLMatcher at the start of the output: requests deep-copy it
    loose: np.ndarray  # every token the vocabulary spells, plus the end tokens (sorted)
    single: np.ndarray  # [len(CLOSING_BYTES)] the token id spelling each closing byte alone, -1 if none
    min_tokens: int = field(init=False)
    proven: bool = field(init=False)  # a witness from the start was found: walks are budget-forced
    witness: list[int] | None = field(init=False, repr=False)  # that witness (each walk starts from it)

    def __post_init__(self) -> None:
        self.min_tokens, self.proven, self.witness = 0, True, None
        self.witness = self.for_request().witness(0, MAX_WITNESS)
        # tokens of the shortest output the witness finds, its end token included (>= the true minimum);
        # without a witness the budget cannot be kept by construction: outputs cut by it end as `length`
        self.proven = self.witness is not None
        self.min_tokens = 1 if self.witness is None else len(self.witness) + 1

    def for_request(self) -> GrammarWalk:
        return GrammarWalk(self)

    def accepts(self, tokens: Iterable[int]) -> bool:
        """Whether a whole token sequence (ending on an end token) is in the language."""
        m = self.matcher.deep_copy()
        for t in tokens:
            if t in self.end_ids:
                return bool(m.is_accepting())
            if not m.consume_token(int(t)):
                return False
        return False


class GrammarWalk:
    """One request's progress through a GrammarGuide, with the interface runtime.guided uses for automata.

    States are numbered by the tokens consumed along the request's single path (0 = start); queries are
    only valid at the head, which is where the frontier always is. `step` consumes a token only when a
    completion after it still fits the budget, so the head always has a witness that does."""

    def __init__(self, guide: GrammarGuide):
        self.guide = guide
        self.spec, self.end_ids, self.loose = guide.spec, guide.end_ids, guide.loose
        self.min_tokens = guide.min_tokens
        self.matcher = guide.matcher.deep_copy()
        self.head = 0
        self._ends = np.asarray(sorted(set(guide.end_ids)), dtype=np.int64)
        self._bits: np.ndarray | None = None  # the head's mask, packed little-endian (llguidance's layout)
        # a completion from the head (tokens before the end token)
        self._witness: list[int] | None = guide.witness
        # False once no witness was found: the walk then follows the grammar alone (no budget forcing)
        self.proven = guide.proven

    def for_request(self) -> GrammarWalk:
        return self

    def _check(self, state: int) -> None:
        if state != self.head:
            raise RuntimeError(f"grammar walk queried at state {state}, its head is {self.head}")

    def _mask_bits(self) -> np.ndarray:
        if self._bits is None:
            if self.matcher.is_error():
                raise RuntimeError(f"llguidance matcher failed: {self.matcher.get_error()}")
            self._bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return self._bits

    def _allows(self, bits: np.ndarray, token: int) -> bool:
        return 0 <= token < self.guide.vocab_size and bool((bits[token >> 3] >> (token & 7)) & 1)

    def _advance(self, token: int) -> bool:
        """Consume `token` at the head; False (nothing consumed, no error state) if the parser refuses it.
        `try_consume_tokens`, not `consume_token`: a refused token must not leave the matcher in llguidance's
        sticky error state (a mask can hold a token the parser then refuses under `patternProperties`)."""
        if self.matcher.try_consume_tokens([token]) != 1:
            return False
        self.head += 1
        self._bits = None
        return True

    def is_final(self, state: int) -> bool:
        self._check(state)
        return bool(self.matcher.is_accepting())

    def witness(self, state: int, cap: int) -> list[int] | None:
        """A completion from the head of at most `cap` tokens (end token excluded), or None if the rollout
        (closing bytes first) does not find one that short. Deterministic in the state: the witness after
        its own first token is its tail."""
        self._check(state)
        if not self.proven:
            return None
        if self._witness is not None:
            return self._witness if len(self._witness) <= cap else None
        m, taken = self.matcher, []
        found = True
        while not m.is_accepting():
            if len(taken) >= min(cap, MAX_WITNESS):
                found = False
                break
            tok = self._pick(m, taken)  # consumed
            if tok is None:
                found = False
                break
            taken.append(tok)
        if taken and not m.rollback(len(taken)):
            raise RuntimeError(
                f"llguidance could not roll back a witness rollout of {len(taken)} tokens: {m.get_error()}"
            )
        if not found:
            if len(taken) >= MAX_WITNESS:  # not a budget question: the rollout found no completion
                self.proven = False
            return None
        self._witness = taken
        return taken

    def _pick(self, m: Any, taken: list[int]) -> int | None:
        """A rollout's next token, consumed: one after which the output may end, else the first closing byte
        allowed (else the lowest allowed token id), avoiding the token of a run of REPEAT_RUN equal tokens
        (`a` forever under the pattern `a+b`). The closing bytes are checked one by one (`validate_tokens`, no
        state change), which costs microseconds where a full mask over 262k tokens costs milliseconds."""
        options = [int(t) for t in self.guide.single if t >= 0 and m.validate_tokens([int(t)]) == 1]
        if not options:
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[: self.guide.vocab_size])
            options = allowed[~np.isin(allowed, self._ends)][:16].tolist()
        for t in options[:8]:
            if m.try_consume_tokens([t]) == 1:
                if m.is_accepting():
                    return t
                m.rollback(1)
        tail = taken[-REPEAT_RUN:]
        if len(tail) == REPEAT_RUN and len(set(tail)) == 1:
            options = [t for t in options if t != tail[0]] + [tail[0]]
        return next((t for t in options if m.try_consume_tokens([t]) == 1), None)

    def allowed(self, state: int, remaining: int) -> np.ndarray:
        """Sorted token ids the head may take with `remaining` tokens left (this one included): the
        grammar's mask, and only the witness's next token when the budget is as tight as the witness."""
        witness = self.witness(state, max(remaining - 1, 0))
        if witness is not None and len(witness) >= remaining - 1:  # tight: only the witness is known to fit
            return self._ends if not witness else np.asarray([witness[0]], dtype=np.int64)
        toks = np.flatnonzero(np.unpackbits(self._mask_bits(), bitorder="little")[: self.guide.vocab_size])
        toks = toks[~np.isin(toks, self._ends)]
        if self.is_final(state):
            toks = np.union1d(toks, self._ends)
        return toks.astype(np.int64)

    def step(self, state: int, token: int, remaining: int) -> int | None:
        """Consume `token` at the head if the grammar allows it and a completion after it fits the
        `remaining` tokens (this one included, and the end token after the completion); the new head, or
        None (nothing consumed)."""
        self._check(state)
        witness = self._witness
        if witness and witness[0] == token and len(witness) <= remaining - 1 and self._advance(token):
            self._witness = witness[1:]
            return self.head
        if not self._allows(self._mask_bits(), token) or not self._advance(token):
            return None
        self._witness = None
        if self.proven and self.witness(self.head, remaining - 2) is None and self.proven:
            self.matcher.rollback(1)
            self.head -= 1
            self._bits, self._witness = None, witness
            return None
        return self.head

    def forced(self, state: int, remaining: int) -> int:
        """The token the witness takes next (an end token once the head accepts): always fits the budget
        when the walk is proven."""
        witness = self.witness(state, max(remaining - 1, 0))
        if witness is not None:
            return int(witness[0]) if witness else self.end_ids[0]
        self.proven = False  # no witness fits: the grammar alone from here (the output may be cut)
        if self.is_final(state):
            return self.end_ids[0]
        for t in self.allowed(state, remaining).tolist():
            if self.matcher.try_consume_tokens([t]) == 1:
                self.matcher.rollback(1)
                return int(t)
        raise RuntimeError("constrained decoding: the grammar allows no token here")


@dataclass(frozen=True)
class GrammarVocab:
    """What every grammar guide over one vocabulary shares, built once per tokenizer (over 262k tokens the
    dictionary and sort below take ~100 ms: not something to redo per compile)."""

    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int
    end_ids: tuple[int, ...]
    single: np.ndarray  # [len(CLOSING_BYTES)] the token id spelling each closing byte alone, -1 if none
    loose: np.ndarray  # every token the vocabulary spells, plus the end tokens (sorted)

    @classmethod
    def build(cls, vocab: dict[int, bytes], vocab_size: int, end_ids: Sequence[int]) -> GrammarVocab:
        by_bytes = {b: i for i, b in sorted(vocab.items(), reverse=True) if i not in end_ids}
        single = np.asarray([by_bytes.get(bytes([b]), -1) for b in CLOSING_BYTES], dtype=np.int64)
        ends = np.asarray(sorted(set(end_ids)), dtype=np.int64)
        loose = np.union1d(np.fromiter(vocab, dtype=np.int64, count=len(vocab)), ends)
        tokenizer = llg_tokenizer(vocab, vocab_size, end_ids)
        return cls(tokenizer, vocab_size, tuple(end_ids), single, loose)


def compile_grammar_guide(spec: Any, gv: GrammarVocab) -> GrammarGuide:
    """A json_schema / lark_grammar GuideSpec -> GrammarGuide over the vocabulary."""
    matcher = compile_grammar(spec.kind, spec.guide, gv.tokenizer)
    try:
        return GrammarGuide(spec, gv.vocab_size, gv.end_ids, matcher, gv.loose, gv.single)
    except RuntimeError as e:  # the witness search reached a state no token of this vocabulary continues
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(
            f"{spec.kind} guide cannot be completed with this tokenizer's tokens ({first})",
            "use only text the model's tokens can spell",
        ) from e
