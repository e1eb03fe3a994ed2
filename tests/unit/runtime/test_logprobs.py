"""Log-probabilities from the runtime: each committed token's is read from the distribution of the denoise
pass whose argmax canvas was committed (its last live pass), checked against that pass's probabilities
recorded independently from the backend; asking for them changes no token; constrained rows read them from
the masked distribution they were decoded from."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.errors import InputError
from pipeline.model.config import SamplerConfig
from pipeline.runtime.backends import TorchBackend
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from tests._utils.tiny import build_tiny

FIXED = SamplerConfig(max_denoising_steps=3, confidence_threshold=0.0)


class Recording(TorchBackend):
    """The PyTorch backend, keeping a copy of every step's probabilities and argmax canvas."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def denoise_step(self, *args, **kwargs):
        res = super().denoise_step(*args, **kwargs)
        self.steps.append((res.step.probs.clone(), res.step.argmax.clone()))
        return res


def test_each_token_has_its_committing_pass_probability_and_top_alternatives():
    model = build_tiny(torch.float64)
    model.cfg.eos_token_id = [999]  # no end token: exactly one full canvas
    backend = Recording(model)
    rt = BlockDiffusionRuntime(backend, max_batch=1, max_len=64)
    res = rt.generate([Request([2, 5, 6], max_tokens=8, sampler=FIXED, seed=3, logprobs=5)])[0]
    assert len(backend.steps) == 3 and len(res.logprobs) == len(res.tokens) == 8
    probs, argmax = backend.steps[-1]  # the last pass: its argmax canvas is what was committed
    assert res.tokens == argmax[0].tolist()
    for pos, (token, (lp, top)) in enumerate(zip(res.tokens, res.logprobs, strict=True)):
        p = probs[0, pos]
        assert lp == pytest.approx(math.log(p[token].item()), rel=1e-6)
        values, ids = p.topk(5)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.log().tolist(), rel=1e-6)
        assert top[0] == (token, pytest.approx(lp))  # the committed token is that pass's argmax
    # the sequence's log-probability: the sum over the returned tokens, a proper log-probability
    assert sum(lp for lp, _ in res.logprobs) < 0


def test_logprobs_change_no_token_and_batch_rows_keep_their_own():
    model = build_tiny(torch.float64)
    model.cfg.eos_token_id = [999]
    plain = [Request([2, 5], max_tokens=20, sampler=FIXED, seed=s, request_id=s) for s in range(3)]
    asked = [
        Request([2, 5], max_tokens=20, sampler=FIXED, seed=s, request_id=s, logprobs=s) for s in range(3)
    ]
    mixed = [plain[0], asked[1], asked[2]]
    a = BlockDiffusionRuntime(model, max_batch=3, max_len=128).generate(plain)
    b = BlockDiffusionRuntime(model, max_batch=3, max_len=128).generate(mixed)
    alone = BlockDiffusionRuntime(model, max_batch=1, max_len=128).generate([asked[2]])[0]
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert b[0].logprobs == []
    assert [len(top) for _, top in b[1].logprobs] == [1] * 20  # each row its own top-k
    assert [len(top) for _, top in b[2].logprobs] == [2] * 20
    got = [(lp, [i for i, _ in top]) for lp, top in b[2].logprobs]
    want = [(lp, [i for i, _ in top]) for lp, top in alone.logprobs]
    assert [i for _, i in got] == [i for _, i in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-9)


def test_top_logprobs_out_of_range_is_refused():
    rt = BlockDiffusionRuntime(build_tiny(), max_batch=1, max_len=64)
    with pytest.raises(InputError, match=r"top logprobs must be in \[0, 20\]"):
        rt.validate(Request([2], logprobs=21))


def test_constrained_rows_read_the_masked_distribution(tmp_path):
    """A constrained token's log-probability and alternatives come from the masked distribution it was
    decoded from: taken by the guide during the passes, that pass's; decoded when the canvas ends, the last
    pass's over what the guide allowed there. A token the language never spells has no mass there (the
    unmasked distribution of a later pass would give it some: this random model puts most of its mass
    elsewhere)."""
    from pipeline.runtime.session import load_session
    from tests._utils.chat import write_chat_checkpoint

    session = load_session(write_chat_checkpoint(tmp_path / "chat"), device="cpu")
    automaton = session.compile_guide("regex", "(yes|no)")
    req = Request(session.encode_prompt("Answer:"), max_tokens=16, sampler=session.sampler(), seed=1,
                  guide=automaton, logprobs=3)  # fmt: skip
    res = BlockDiffusionRuntime(session.model, max_batch=1, max_len=256).generate([req])[0]
    assert session.decode(res.tokens) in ("yes", "no")
    assert len(res.logprobs) == len(res.tokens)
    loose = set(automaton.loose.tolist())  # every token the language spells, and the end tokens
    for token, (lp, top) in zip(res.tokens, res.logprobs, strict=True):
        assert -math.inf < lp <= 0  # the token had mass under the masked distribution it came from
        assert lp <= top[0][1] + 1e-6 and len(top) == 3
        assert token != top[0][0] or lp == pytest.approx(top[0][1], abs=1e-6)
        with_mass = [(t, v) for t, v in top if v > -math.inf]
        assert {t for t, _ in with_mass} <= loose, top
        assert sum(math.exp(v) for _, v in with_mass) <= 1 + 1e-5
