"""Log-probabilities from the runtime: each committed token's is read from the distribution of the denoise
pass whose argmax canvas was committed (its last live pass), checked against that pass's probabilities
recorded independently from the backend; asking for them changes no token; constrained rows read them from
the masked distribution they were decoded from."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.errors import InputError
from pipeline.model.config import SamplerConfig
from pipeline.runtime.backends import TorchBackend, sample_logits
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from pipeline.sampler.reference import conditioning_softmax
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


class KernelLike(TorchBackend):
    """The PyTorch backend handing back what the CUDA kernels hand back: as probs the self-conditioning input
    softmax(bf16(z)) in bf16, not softmax(z), and the logits beside them."""

    def denoise_step(self, canvas, sc_soft, positions, masks, past, sampler, need_soft=True):
        logits = self.model.denoise_soft(canvas, sc_soft, positions, masks, past)
        res = sample_logits(logits, sampler, self.draws)
        res.soft = self.model.soft_embedding(self.conditioning(logits, sampler, res.step))
        z = logits / sampler.temperature[:, None, None]
        res.step.probs, res.logits = conditioning_softmax(z, torch.bfloat16).to(torch.bfloat16), logits
        return res


def test_log_probabilities_are_of_the_sampled_distribution_where_the_probs_are_the_conditioning_input():
    """The CUDA kernels' probs are softmax(bf16(z)), up to ~0.16 nats from softmax(z) at a 262k vocabulary:
    log-probabilities (and a guide's ranking) are read from the logits there, so a request's log-probabilities
    are the PyTorch path's, to fp32's precision."""
    model = build_tiny(torch.float64)
    model.cfg.eos_token_id = [999]
    reqs = [
        Request([2, 5, 6], max_tokens=16, sampler=FIXED, seed=s, request_id=s, logprobs=3) for s in range(2)
    ]
    want = BlockDiffusionRuntime(TorchBackend(model), max_batch=2, max_len=128).generate(reqs)
    got = BlockDiffusionRuntime(KernelLike(model), max_batch=2, max_len=128).generate(reqs)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        assert [lp for lp, _ in g.logprobs] == pytest.approx([lp for lp, _ in w.logprobs], rel=1e-6, abs=1e-6)
        assert [[i for i, _ in top] for _, top in g.logprobs] == [
            [i for i, _ in top] for _, top in w.logprobs
        ]


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
        # bf16 probabilities (a pass's, for tokens taken during the passes): each rounded by up to 2^-9
        assert sum(math.exp(v) for _, v in with_mass) <= 1 + 2**-7


def test_a_decoded_positions_distribution_is_its_allowed_tokens_renormalised():
    """`finish_canvas` ranks the allowed tokens by the last pass's masked probabilities: those renormalised,
    the top k among them (padded with tokens of no mass where fewer are allowed), and where every allowed
    token underflowed, no mass (-inf), never 0/0."""
    from pipeline.runtime.guided import decoded_logprob

    allowed = np.array([5, 9, 12])
    p = torch.tensor([0.02, 0.06, 0.02], dtype=torch.bfloat16)  # mass elsewhere: 0.9
    d = decoded_logprob(3, 9, allowed, p, k=2)
    assert d.position == 3 and d.logprob == pytest.approx(math.log(0.6), abs=1e-2)
    assert (
        d.ids[0] == 9
        and d.ids[1] in (5, 12)
        and d.top == pytest.approx([math.log(0.6), math.log(0.2)], abs=1e-2)
    )
    padded = decoded_logprob(0, 12, allowed, p, k=5)
    assert padded.ids[:3] == [9, 5, 12] or padded.ids[:3] == [9, 12, 5]
    assert padded.ids[3:] == [0, 1] and padded.top[3:] == [-math.inf, -math.inf]
    none = decoded_logprob(0, 9, allowed, torch.zeros(3), k=2)  # a low temperature's mass on another token
    assert none.logprob == -math.inf and none.top == [-math.inf, -math.inf] and none.ids[0] in (5, 9, 12)
    assert decoded_logprob(0, 7, allowed, p, k=0) == decoded_logprob(0, 7, allowed, p, k=0)  # not allowed
    assert decoded_logprob(0, 7, allowed, p, k=0).logprob == -math.inf


def test_constrained_logprobs_at_temperature_zero_have_no_nan(tmp_path):
    """OpenAI's temperature 0 (T = 0.001 here): the allowed tokens of a decoded position can all underflow;
    their log-probabilities are -inf (the API's floor), not NaN, which JSON cannot carry."""
    import json

    from pipeline.runtime.session import load_session
    from pipeline.serving.openai_schema import temperature_range
    from tests._utils.chat import write_chat_checkpoint

    session = load_session(write_chat_checkpoint(tmp_path / "chat"), device="cpu")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    automaton = session.compile_guide("json_schema", json.dumps(schema))
    t_min, t_max = temperature_range(0.0)
    sampler = session.sampler().model_copy(update={"t_min": t_min, "t_max": t_max})
    ids = session.encode_prompt("Answer:")
    reqs = [Request(ids, max_tokens=64, sampler=sampler, seed=s, request_id=s, guide=automaton, logprobs=2)
            for s in range(4)]  # fmt: skip
    results = BlockDiffusionRuntime(session.model, max_batch=4, max_len=512).generate(reqs)
    values = [v for r in results for lp, top in r.logprobs for v in (lp, *(x for _, x in top))]
    assert values and not any(math.isnan(v) for v in values)
    assert all(isinstance(json.loads(session.decode(r.tokens))["ok"], bool) for r in results)
