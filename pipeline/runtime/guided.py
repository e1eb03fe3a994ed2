"""Automaton-guided acceptance: how a constrained request's canvas is denoised so that what it commits is
valid by construction (docs/constrained.md).

Per row, the host keeps the DFA state reached by the canvas prefix accepted so far (the *frontier*):
  * before a pass: the frontier position may only hold tokens the DFA allows there with the token budget
    left; positions beyond it any token of the language (the state there is not known yet); accepted
    positions are pinned through the infill template, which the sampler already honours;
  * after a pass: walk the argmax canvas from the frontier and accept each position that the entropy rule
    kept with the same argmax as the pass before (or that is pinned) while its token is allowed; pin what
    was accepted. An accepted end token pins
    the rest of the canvas to PAD: the canvas is then fully determined and stops denoising;
  * when the canvas stops: decode the positions still beyond the frontier left to right from the last
    pass's (masked) distribution, each position's argmax over the tokens its exact DFA state allows.
The DFA state carries across the request's canvases. Each row's masks depend only on its own state, so a
constrained request gives the same output in a batch as alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.sampler.constraints import TokenAutomaton


@dataclass
class GuideState:
    """One constrained request's progress through its automaton."""

    automaton: TokenAutomaton
    room: int  # tokens the whole output may take (max_tokens and the context), the end token included
    emitted: int = 0  # tokens emitted by committed canvases
    state: int = 0  # DFA state after the accepted prefix
    frontier: int = 0  # canvas positions accepted in the current canvas
    ended: bool = False  # an end token was accepted

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
            if not (a.final[g.state] and rem >= 1):
                break
            g.ended = True
            pins[i] = tok
            pins.update({j: pad_id for j in range(i + 1, length)})
            i = length
            break
        nxt = a.next_state(g.state, tok)
        if nxt is None or a.distance[nxt] > rem - 2:
            break
        pins[i], g.state = tok, nxt
        i += 1
    g.frontier = i
    return pins


def finish_canvas(g: GuideState, block: list[int], probs: torch.Tensor, pad_id: int) -> list[int]:
    """The committed canvas: the accepted prefix, then each later position's most probable allowed token
    under its exact DFA state (`probs` [L, V] is the last pass's masked distribution). Advances the state."""
    a, out = g.automaton, list(block[: g.frontier])
    for i in range(g.frontier, len(block)):
        if g.ended:
            out.append(pad_id)
            continue
        allowed = a.allowed(g.state, g.remaining(i))
        if len(allowed) == 0:  # only when the budget is spent, which the distances rule out
            raise RuntimeError(f"constrained decoding: no token allowed at canvas position {i}")
        idx = torch.from_numpy(allowed).to(probs.device)
        tok = int(allowed[int(torch.argmax(probs[i, idx].float()))])
        out.append(tok)
        if tok in a.end_ids:
            g.ended = True
        else:
            nxt = a.next_state(g.state, tok)
            assert nxt is not None  # `allowed` only holds tokens with a transition
            g.state = nxt
    g.frontier = len(block)
    return out
