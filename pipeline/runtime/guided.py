"""Automaton-guided acceptance: how a constrained request's canvas is denoised so that what it commits is
valid by construction (docs/constrained.md).

Per row, the host keeps the guide's state reached by the canvas prefix accepted so far (the *frontier*) — a
DFA state for regular guides, the head of the request's own llguidance walk for JSON schemas and grammars:
  * before a pass: the frontier position may only hold tokens the DFA allows there with the token budget
    left; positions beyond it any token of the language (the state there is not known yet); accepted
    positions are pinned through the infill template, which the sampler already honours;
  * after a pass: walk the argmax canvas from the frontier and accept each position that the entropy rule
    kept with the same argmax as the pass before (or that is pinned) while its token is allowed; pin what
    was accepted. An accepted end token pins
    the rest of the canvas to PAD: the canvas is then fully determined and stops denoising;
  * when the canvas stops: decode the positions still beyond the frontier left to right from the last
    pass's (masked) distribution, each position's most probable token among those its exact state allows
    that keep the output completable within the budget.
The state carries across the request's canvases. Each row's masks depend only on its own state, so a
constrained request gives the same output in a batch as alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.sampler.constraints import GrammarGuide, TokenAutomaton
from pipeline.sampler.grammar import GrammarWalk


@dataclass
class GuideState:
    """One constrained request's progress through its guide (a shared automaton, or the request's own walk
    of a grammar guide: `for_request`)."""

    automaton: TokenAutomaton | GrammarGuide | GrammarWalk
    room: int  # tokens the whole output may take (max_tokens and the context), the end token included
    emitted: int = 0  # tokens emitted by committed canvases
    state: int = 0  # DFA state after the accepted prefix
    frontier: int = 0  # canvas positions accepted in the current canvas
    ended: bool = False  # an end token was accepted

    def __post_init__(self) -> None:
        self.automaton = self.automaton.for_request()

    def remaining(self, position: int) -> int:
        """Tokens left for the output at canvas `position`, that position included."""
        return self.room - self.emitted - position

    def start_canvas(self, emitted: int) -> None:
        self.emitted, self.frontier = emitted, 0

    def settled(self, length: int) -> bool:
        """Nothing left to denoise in this canvas: every position accepted, or an end token was."""
        return self.ended or self.frontier >= length


def mask_rows(
    guides: list[GuideState | None], length: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This step's compact masks for a batch (`reference.mask_logits`): per constrained row two table rows,
    the frontier's exact set and the language's loose set. None when no row is constrained."""
    if not any(g is not None and not g.settled(length) for g in guides):
        return None
    table_rows: list[torch.Tensor] = []
    index = torch.full((len(guides), length), -1, dtype=torch.long)
    for r, g in enumerate(guides):
        if g is None or g.settled(length):
            continue
        a = g.automaton
        exact = torch.from_numpy(a.allowed(g.state, g.remaining(g.frontier)))
        for toks in (exact, torch.from_numpy(a.loose)):
            row = torch.zeros(vocab, dtype=torch.bool)
            row[toks] = True
            table_rows.append(row)
        index[r, g.frontier] = len(table_rows) - 2
        index[r, g.frontier + 1 :] = len(table_rows) - 1
    table = torch.stack(table_rows) if table_rows else torch.ones(1, vocab, dtype=torch.bool)
    return table.to(device), index.to(device)


def advance(
    g: GuideState, argmax: list[int], prev: list[int], kept: list[bool], pinned: list[bool], pad_id: int
) -> dict[int, int]:
    """Accept positions from the frontier while they are settled and allowed; returns the new pins
    {position: token}. Settled: pinned by the request, or kept by the entropy rule with the same argmax as
    the pass before (`prev`): accepting on the first keep freezes tokens the sampler would still revise,
    which cost the Sudoku model 6 points of solve rate (0.81 vs 0.875 on 48 puzzles); one pass of
    agreement restores it. An accepted end token pins every later position to PAD."""
    a, pins = g.automaton, {}
    i, length = g.frontier, len(argmax)
    while i < length and not g.ended and (pinned[i] or (kept[i] and prev[i] == argmax[i])):
        tok, rem = argmax[i], g.remaining(i)
        if tok in a.end_ids:
            if not (a.is_final(g.state) and rem >= 1):
                break
            g.ended = True
            pins[i] = tok
            pins.update({j: pad_id for j in range(i + 1, length)})
            i = length
            break
        nxt = a.step(g.state, tok, rem)
        if nxt is None:
            break
        pins[i], g.state = tok, nxt
        i += 1
    g.frontier = i
    return pins


def finish_canvas(
    g: GuideState,
    block: list[int],
    probs: torch.Tensor,
    pad_id: int,
    tries: int = 8,
    on_decode: Callable[[int, int, np.ndarray, torch.Tensor], None] | None = None,
    pins: Sequence[int] = (),
) -> list[int]:
    """The committed canvas: the accepted prefix, then each later position's most probable token under its
    exact state (`probs` [L, V] is the last pass's masked distribution) among the first `tries` that keep
    the output completable in the budget, else the token the guide's shortest completion takes (always
    fits). Advances the state. `on_decode(position, token, allowed, p)`: each decoded position's token,
    the tokens its state allowed and their probabilities, which ranked them. `pins`: the request's infill
    template (-1 free): a pinned position keeps its token where the guide allows it there, else it is decoded
    like the others (validity wins over the pin)."""
    a, out = g.automaton, list(block[: g.frontier])
    for i in range(g.frontier, len(block)):
        if g.ended:
            out.append(pad_id)
            continue
        rem = g.remaining(i)
        allowed = a.allowed(g.state, rem)
        if len(allowed) == 0:  # only when the budget is spent, which the distances rule out
            raise RuntimeError(f"constrained decoding: no token allowed at canvas position {i}")
        p = probs[i, torch.from_numpy(allowed).to(probs.device)].float()
        pinned = pins[i] if i < len(pins) else -1
        if pinned >= 0 and _take(g, pinned, rem):
            tok: int | None = pinned
        else:
            ranked = [int(allowed[j]) for j in torch.argsort(p, descending=True)[:tries].tolist()]
            tok = next((t for t in ranked if _take(g, t, rem)), None)
        if tok is None:
            tok = a.forced(g.state, rem)
            taken = _take(g, tok, rem)
            assert taken  # the shortest completion's next token always fits
        out.append(tok)
        if on_decode is not None:
            on_decode(i, tok, allowed, p)
    g.frontier = len(block)
    return out


@dataclass(frozen=True)
class DecodedLogprob:
    """A position `finish_canvas` decoded: its token's log-probability under the distribution that ranked it,
    and that distribution's top k (log-probabilities and ids), padded to k with tokens of no mass."""

    position: int
    logprob: float
    top: list[float]
    ids: list[int]


def decoded_logprob(
    position: int, token: int, allowed: np.ndarray, p: torch.Tensor, k: int
) -> DecodedLogprob:
    """`finish_canvas` ranks the tokens the guide allows at `position` by `p`, the last pass's masked
    probabilities of `allowed`, so `p` renormalised over them is the distribution the token was decoded from.
    Work over the allowed tokens only (a full vocabulary per position costs ~1 ms each on a CPU). Where every
    allowed token underflowed to 0 (a low temperature's mass on a token this state does not allow) there is
    no mass: -inf, which the API reports at its floor, not 0/0."""
    q = p.float()
    q = (q / q.sum().clamp_min(torch.finfo(torch.float32).tiny)).cpu()
    at = np.flatnonzero(allowed == token)
    mass = float(q[int(at[0])]) if len(at) else 0.0
    n = min(k, len(allowed))
    values, index = q.topk(n)
    top = [math.log(v) if v > 0 else -math.inf for v in values.tolist()]
    ids = [int(allowed[i]) for i in index.tolist()]
    if n < k:  # fewer allowed tokens than asked for: the rest have no mass
        taken = set(ids)
        ids += [t for t in range(k + n) if t not in taken][: k - n]
        top += [-math.inf] * (k - n)
    return DecodedLogprob(position, math.log(mass) if mass > 0 else -math.inf, top, ids)


def _take(g: GuideState, tok: int, rem: int) -> bool:
    """Advance the state by `tok` if it keeps the output completable within `rem` tokens."""
    a = g.automaton
    if tok in a.end_ids:
        if a.is_final(g.state) and rem >= 1:
            g.ended = True
            return True
        return False
    nxt = a.step(g.state, tok, rem)
    if nxt is None:
        return False
    g.state = nxt
    return True
