"""The constraint compiler: a JSON schema, Lark grammar, regular expression or choice list -> a guide over the
tokenizer's vocabulary, which the denoiser enforces per canvas position (docs/constrained.md).

Two engines, each where it is exact:
  * regular guides (`regex`, `choice`, `json` = any one-level JSON object) -> outlines-core's token DFA
    (`Index` over the vocabulary's byte strings) -> `TokenAutomaton`, which adds what a *diffusion*
    canvas needs: `distance[state]`, the fewest tokens to acceptance (so a position only takes tokens
    after which the output can still end within the budget: budget forcing, provable on a finite
    automaton), and `loose`, the mask for positions beyond the accepted prefix;
  * context-free guides (`json_schema`, `lark_grammar`) -> llguidance (grammar.py): the schema is compiled
    to a grammar directly, validation keywords are honoured or refused with their JSON pointer, and the
    budget is kept by a witness completion instead of a distance table.
Both answer the same queries (`allowed`, `step`, `is_final`, `forced`, `loose`), which runtime.guided uses.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from pipeline.errors import InputError
from pipeline.sampler.grammar import GrammarGuide, GrammarVocab, compile_grammar_guide

# guide types: TensorRT-LLM's names (`json` = any JSON object) plus `choice` (guide = JSON list of strings)
GUIDE_TYPES = ("json", "json_schema", "regex", "choice", "lark_grammar")
GRAMMAR_TYPES = ("json_schema", "lark_grammar")  # compiled by llguidance (grammar.py)
REFUSED_GUIDE_TYPES = {
    "ebnf_grammar": "EBNF grammars",
    "structural_tag": "structural tags",
}

WHITESPACE = r"[ ]?"  # between JSON tokens: at most one space, so outputs stay short on a 256-token canvas


@dataclass(frozen=True)
class GuideSpec:
    """What a request asks for: a guide type (GUIDE_TYPES) and its text (schema JSON, regex, choices JSON)."""

    kind: str
    guide: str

    def check(self) -> None:
        """Refuse a guide that cannot be compiled, before any tokenizer or model is loaded (InputError naming
        the construct): the CLI and the API call this on the request path."""
        if self.kind in GRAMMAR_TYPES:
            from pipeline.sampler.grammar import compile_grammar

            compile_grammar(self.kind, self.guide, None)
        else:
            self.regex()

    def regex(self) -> str:
        """The regular expression the output must match in full (regular guide types only)."""
        if self.kind in REFUSED_GUIDE_TYPES:
            raise InputError(
                f"guided decoding type {self.kind!r}: {REFUSED_GUIDE_TYPES[self.kind]} are not supported",
                f"use one of: {', '.join(GUIDE_TYPES)}",
            )
        if self.kind == "regex":
            if not self.guide:
                raise InputError("guided regex is empty", "pass the pattern the whole output must match")
            try:
                re.compile(self.guide)
            except re.error as e:
                raise InputError(f"guided regex {self.guide!r} does not compile: {e}") from e
            return self.guide
        if self.kind == "choice":
            return "|".join(re.escape(c) for c in parse_choices(self.guide))
        if self.kind == "json":
            return any_json_object_regex()
        if self.kind in GRAMMAR_TYPES:
            raise ValueError(f"{self.kind} guides are context-free: compile them with grammar.py")
        raise InputError(
            f"guided decoding type {self.kind!r} is unknown", f"use one of: {', '.join(GUIDE_TYPES)}"
        )


def parse_choices(guide: str | Sequence[str]) -> list[str]:
    """A choice guide: a JSON list of strings (or the list itself); empty lists and choices are refused."""
    choices: Any = guide
    if isinstance(guide, str):
        try:
            choices = json.loads(guide)
        except ValueError as e:
            raise InputError(f"guided choice must be a JSON list of strings: {e}") from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InputError("guided choice must be a non-empty list of non-empty strings")
    return choices


def any_json_object_regex() -> str:
    """`json` (any JSON object): an object whose values are scalars or arrays of scalars. outlines-core's
    regex for `{"type": "object"}` nests objects three deep and its token index takes ~30 s to build even
    over a 100-token vocabulary; one level builds in milliseconds. Deeper outputs: pass a schema."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING

    w = WHITESPACE
    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"
    value = rf"({scalar}|\[{w}({scalar}({w},{w}{scalar})*)?{w}\])"
    member = f"{STRING}{w}:{w}{value}"
    return rf"\{{{w}({member}({w},{w}{member})*)?{w}\}}"


def _decoder_kinds(node: Any) -> set[str]:
    if isinstance(node, dict):
        kinds = {node.get("type", "")}
        for value in node.values():
            kinds |= _decoder_kinds(value)
        return kinds
    if isinstance(node, list):
        return set().union(*(_decoder_kinds(n) for n in node)) if node else set()
    return set()


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode table (ByteLevel pre-tokenizers spell bytes with it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer: Any, vocab_size: int) -> dict[int, bytes]:
    """The bytes each (non-special) token id spells, from a `tokenizers.Tokenizer`: byte-level BPE (GPT-2
    table), SentencePiece-style (▁ for space, <0xNN> byte fallback) and plain (character/word) vocabularies."""
    kinds = _decoder_kinds(json.loads(tokenizer.to_str()).get("decoder"))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    table = _byte_level_table() if "ByteLevel" in kinds else None
    spaced = bool(kinds & {"Metaspace", "Replace"})
    out: dict[int, bytes] = {}
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in special or i >= vocab_size:
            continue
        if table is not None:
            if all(c in table for c in token):
                out[i] = bytes(table[c] for c in token)
            continue
        if m := _BYTE_FALLBACK.match(token):
            out[i] = bytes([int(m.group(1), 16)])
            continue
        out[i] = (token.replace("▁", " ") if spaced else token).encode()
    return {i: b for i, b in out.items() if b}


@dataclass
class TokenAutomaton:
    """A token-level DFA over a vocabulary with the budget-aware queries the denoiser needs.

    States are renumbered 0..S-1 (0 = initial). `allowed(state, remaining)` is the set of tokens a position
    may hold when `remaining` tokens (this one included) are left for the whole output: a token whose next
    state can still reach acceptance and emit an end token in time, or an end token in an accepting state.
    """

    spec: GuideSpec
    vocab_size: int
    end_ids: tuple[int, ...]
    # per state, sorted token ids and their next states: arrays, not dicts (a 24-character string field
    # over a 65k vocabulary is 1.3M edges: ~20 MB as arrays, ~10x that as Python dicts)
    tokens: list[np.ndarray]  # [S] of int64 [E_s], sorted
    nexts: list[np.ndarray]  # [S] of int32 [E_s]
    final: np.ndarray  # [S] bool
    distance: np.ndarray  # [S] int64: fewest tokens to an accepting state (large when unreachable)
    loose: np.ndarray  # token ids that occur on any transition, plus the end tokens (sorted)
    _next_dist: list[np.ndarray] = field(default_factory=list, repr=False)
    _cache: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        finite = self.distance[self.distance < UNREACHABLE]
        # beyond this many remaining tokens the budget rules nothing out: one cache entry per state
        self._cap = int(finite.max(initial=0)) + 2
        self._next_dist = [self.distance[n] for n in self.nexts]

    @property
    def n_states(self) -> int:
        return len(self.tokens)

    @property
    def min_tokens(self) -> int:
        """Tokens the shortest valid output takes, its end token included."""
        return int(self.distance[0]) + 1

    def next_state(self, state: int, token: int) -> int | None:
        toks = self.tokens[state]
        i = int(np.searchsorted(toks, token))
        return int(self.nexts[state][i]) if i < len(toks) and toks[i] == token else None

    def allowed(self, state: int, remaining: int) -> np.ndarray:
        """Sorted token ids a position may hold in `state` with `remaining` tokens left (this one included)."""
        key = (state, min(remaining, self._cap))
        hit = self._cache.get(key)
        if hit is None:
            toks = self.tokens[state][self._next_dist[state] <= remaining - 2]
            if self.final[state] and remaining >= 1:
                toks = np.union1d(toks, np.asarray(self.end_ids, dtype=np.int64))
            hit = self._cache[key] = toks
        return hit

    def for_request(self) -> TokenAutomaton:
        """The automaton is stateless (a request's state is an int in its GuideState): shared as it is."""
        return self

    def is_final(self, state: int) -> bool:
        return bool(self.final[state])

    def step(self, state: int, token: int, remaining: int) -> int | None:
        """The state after `token` if it is allowed and the output can still end within `remaining` tokens
        (this one included), else None."""
        nxt = self.next_state(state, token)
        return None if nxt is None or self.distance[nxt] > remaining - 2 else nxt

    def forced(self, state: int, remaining: int) -> int:
        """A token that always fits: the end token in an accepting state, else one nearest to acceptance."""
        if self.final[state]:
            return self.end_ids[0]
        return int(self.tokens[state][int(np.argmin(self._next_dist[state]))])

    def accepts(self, tokens: Iterable[int]) -> bool:
        """Whether a whole token sequence (ending on an end token) is in the language: the test oracle's twin."""
        state = 0
        for t in tokens:
            if t in self.end_ids:
                return bool(self.final[state])
            nxt = self.next_state(state, t)
            if nxt is None:
                return False
            state = nxt
        return False


UNREACHABLE = np.iinfo(np.int64).max // 4


def compile_automaton(
    spec: GuideSpec, vocab: dict[int, bytes], vocab_size: int, end_ids: Sequence[int]
) -> TokenAutomaton:
    """Regex (from the spec) -> outlines-core token index -> a TokenAutomaton with distances to acceptance."""
    from outlines_core import Index, Vocabulary

    if not end_ids:
        raise InputError("constrained decoding needs the checkpoint's end token ids")
    regex = spec.regex()
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in vocab.items():
        if i not in end_ids:
            by_bytes.setdefault(b, []).append(i)
    try:
        index = Index(regex, Vocabulary(end_ids[0], by_bytes))
    except Exception as e:  # outlines-core raises ValueError on regexes it cannot build
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if (
            len(first) > 200
        ):  # outlines-core quotes the whole compiled regex (1 kB for `json`): the error says why
            first = first[:200] + " ..."
        raise InputError(
            f"{spec.kind} guide cannot be compiled over this tokenizer: {first}",
            "change the guide so that this model's tokens can spell it",
        ) from e
    raw = index.get_transitions()
    order = [index.get_initial_state(), *sorted(s for s in raw if s != index.get_initial_state())]
    finals = set(index.get_final_states())
    order += sorted(s for s in finals if s not in raw)
    ids = {s: n for n, s in enumerate(order)}
    ends = np.asarray(sorted(set(end_ids)), dtype=np.int64)
    tokens, nexts = [], []
    for s in order:
        edges = raw.pop(s, {})  # freed as it goes: the dicts are the compile's peak memory
        toks = np.fromiter(edges.keys(), dtype=np.int64, count=len(edges))
        nxt = np.fromiter((ids.get(n, -1) for n in edges.values()), dtype=np.int32, count=len(edges))
        keep = (nxt >= 0) & ~np.isin(toks, ends)
        order_s = np.argsort(toks[keep], kind="stable")
        tokens.append(toks[keep][order_s])
        nexts.append(nxt[keep][order_s])
    final = np.array([s in finals for s in order], dtype=bool)
    # fewest tokens to acceptance: BFS from the accepting states over reversed edges
    incoming: list[set[int]] = [set() for _ in order]
    for s, nxt in enumerate(nexts):
        for n in np.unique(nxt).tolist():
            incoming[n].add(s)
    distance = np.full(len(order), UNREACHABLE, dtype=np.int64)
    queue = deque(np.flatnonzero(final).tolist())
    distance[final] = 0
    while queue:
        s = queue.popleft()
        for prev in incoming[s]:
            if distance[prev] == UNREACHABLE:
                distance[prev] = distance[s] + 1
                queue.append(prev)
    if distance[0] == UNREACHABLE:
        raise InputError(f"{spec.kind} guide: no output over this tokenizer's vocabulary can satisfy it")
    loose = np.unique(np.concatenate([*tokens, ends]))
    return TokenAutomaton(spec, vocab_size, tuple(end_ids), tokens, nexts, final, distance, loose)


Guide = TokenAutomaton | GrammarGuide  # what a Request carries (GuideState walks it per request)


class GuideCompiler:
    """Compiles guides for one tokenizer, keeping recent ones (a server sees the same schema often)."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: Sequence[int], cache_size: int = 32):
        if tokenizer is None:
            raise InputError("constrained decoding needs a tokenizer.json in the checkpoint")
        self._setup(token_bytes(tokenizer, vocab_size), vocab_size, end_ids, cache_size)

    def _setup(
        self, vocab: dict[int, bytes], vocab_size: int, end_ids: Sequence[int], cache_size: int
    ) -> None:
        self.vocab, self.vocab_size, self.end_ids = vocab, vocab_size, tuple(end_ids)
        self._grammar_vocab: GrammarVocab | None = None
        self._compile = lru_cache(maxsize=cache_size)(self.build)

    @classmethod
    def from_vocab(cls, vocab: dict[int, bytes], vocab_size: int, end_ids: Sequence[int]) -> GuideCompiler:
        """A compiler over token byte strings directly (benchmarks over synthetic vocabularies)."""
        self = cls.__new__(cls)
        self._setup(dict(vocab), vocab_size, end_ids, 32)
        return self

    def build(self, spec: GuideSpec) -> Guide:
        """Compile, uncached (a compile worker keeps nothing between guides)."""
        if spec.kind in GRAMMAR_TYPES:
            if not self.end_ids:
                raise InputError("constrained decoding needs the checkpoint's end token ids")
            if self._grammar_vocab is None:
                self._grammar_vocab = GrammarVocab.build(self.vocab, self.vocab_size, self.end_ids)
            return compile_grammar_guide(spec, self._grammar_vocab)
        return compile_automaton(spec, self.vocab, self.vocab_size, self.end_ids)

    def compile(self, spec: GuideSpec) -> Guide:
        return self._compile(spec)
