"""The host side of guided acceptance, step by step: which positions each pass masks and how, what the walk
accepts, and how a stopped canvas is completed within the budget."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.guided import GuideState, advance, finish_canvas, mask_rows
from pipeline.sampler.constraints import GuideCompiler, GuideSpec

END, PAD, L = 1, 0, 6


@pytest.fixture(scope="module")
def compiler():
    from tests._utils.chat import build_tokenizer

    return GuideCompiler(build_tokenizer(), 128, [END])


def ids(compiler, text: str) -> list[int]:
    by_bytes = {b: i for i, b in compiler.vocab.items()}
    return [by_bytes[c.encode()] for c in text]


def test_masks_exact_at_the_frontier_loose_beyond_free_before(compiler):
    a = compiler.compile(GuideSpec("regex", "ab+c"))
    g = GuideState(
        a,
        room=20,
        frontier=2,
        state=a.next_state(a.next_state(0, ids(compiler, "a")[0]), ids(compiler, "b")[0]),
    )
    table, index = mask_rows([None, g], L, 128, torch.device("cpu"))
    assert (index[0] == -1).all() and (index[1, :2] == -1).all()  # free row; accepted prefix is pinned
    exact, loose = table[index[1, 2]], table[index[1, 3]]
    assert exact.nonzero().flatten().tolist() == sorted(ids(compiler, "bc"))
    assert loose.nonzero().flatten().tolist() == sorted([END, *ids(compiler, "abc")])
    assert (index[1, 3:] == index[1, 3]).all()
    assert mask_rows([None, None], L, 128, torch.device("cpu")) is None


def test_walk_accepts_settled_allowed_positions_and_stops_at_the_first_other(compiler):
    a = compiler.compile(GuideSpec("regex", "ab+c"))
    a_, b, c = ids(compiler, "abc")
    g = GuideState(a, room=20)
    argmax = [a_, b, b, c, a_, b]
    # position 2 changed since the last pass: not settled, so the walk stops there
    pins = advance(g, argmax, [a_, b, c, c, 0, 0], [True] * L, [False] * L, PAD)
    assert pins == {0: a_, 1: b} and g.frontier == 2
    # settled now, and 'a' after 'c' is not allowed: stops at 4
    pins = advance(g, argmax, list(argmax), [True] * L, [False] * L, PAD)
    assert pins == {2: b, 3: c} and g.frontier == 4 and a.final[g.state]
    # an end token in an accepting state ends the output: the rest is PAD
    pins = advance(g, [*argmax[:4], END, b], [*argmax[:4], END, b], [True] * L, [False] * L, PAD)
    assert pins == {4: END, 5: PAD} and g.ended and g.settled(L)


def test_walk_never_accepts_what_the_budget_cannot_finish(compiler):
    a = compiler.compile(GuideSpec("regex", "a+b"))
    a_, b = ids(compiler, "ab")
    g = GuideState(a, room=4)  # "aab" + end at most
    argmax = [a_, a_, a_, b, END, PAD]
    advance(g, argmax, list(argmax), [True] * L, [False] * L, PAD)
    assert g.frontier == 2  # a third 'a' would leave no room for 'b' and the end token


def test_finish_canvas_decodes_the_rest_by_exact_state_and_budget(compiler):
    a = compiler.compile(GuideSpec("regex", "a+b"))
    a_, b = ids(compiler, "ab")
    g = GuideState(a, room=5)
    probs = torch.zeros(L, 128)
    probs[:, a_] = 1.0  # the model wants 'a' everywhere
    block = finish_canvas(g, [a_] * L, probs, PAD)
    assert block == [a_, a_, a_, b, END, PAD] and g.ended  # the budget forces 'b' and the end in time
    assert a.accepts(block[:5])
