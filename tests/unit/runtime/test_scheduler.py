"""Block-diffusion runtime behaviour: trimming, infill, batching independence, cancellation, limits."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import InputError
from pipeline.model.config import SamplerConfig
from pipeline.runtime.backends import TorchBackend
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request, emitted_tokens
from tests._utils.tiny import build_tiny

FIXED = SamplerConfig(max_denoising_steps=3, confidence_threshold=0.0)


def run(model, reqs, **kw):
    return BlockDiffusionRuntime(
        model, max_batch=kw.pop("max_batch", len(reqs)), max_len=kw.pop("max_len", 128)
    ).generate(reqs)


def no_end(model) -> None:
    model.cfg.eos_token_id = [999]  # unreachable: every canvas continues


@pytest.mark.parametrize("max_tokens", [1, 5, 8, 13, 24])
def test_max_tokens_without_overshoot(max_tokens):
    model = build_tiny()
    no_end(model)
    res = run(model, [Request(prompt_ids=[2, 5, 6], max_tokens=max_tokens, sampler=FIXED)])[0]
    assert len(res.tokens) == max_tokens
    assert res.finish_reason == "length"
    assert len(res.steps_per_canvas) == -(-max_tokens // 8) == res.steps_per_canvas.count(3)


def test_end_token_trims_and_stops():
    model = build_tiny()
    res = run(model, [Request(prompt_ids=[2, 5], max_tokens=200, sampler=FIXED, seed=s) for s in range(16)])
    stopped = [r for r in res if r.finish_reason == "stop"]
    assert stopped, "with 2 end tokens in a 24-token vocabulary some request must stop"
    for r in stopped:
        assert r.tokens[-1] in (1, 4) and not set(r.tokens[:-1]) & {1, 4}


def test_ignore_eos_and_min_tokens_keep_generating_past_end_tokens():
    model = build_tiny()
    seeds = range(16)
    ended = run(model, [Request(prompt_ids=[2, 5], max_tokens=40, sampler=FIXED, seed=s) for s in seeds])
    early = [s for s, r in zip(seeds, ended, strict=True) if r.finish_reason == "stop" and len(r.tokens) < 20]
    assert early, "some request must end on an end token before 20 tokens"
    res = run(
        model,
        [Request(prompt_ids=[2, 5], max_tokens=40, min_tokens=40, sampler=FIXED, seed=s) for s in early],
    )
    assert all(len(r.tokens) == 40 and r.finish_reason == "length" for r in res)  # ignore_eos
    res = run(
        model,
        [Request(prompt_ids=[2, 5], max_tokens=40, min_tokens=20, sampler=FIXED, seed=s) for s in early],
    )
    for r in res:  # an end token stops the request only after 20 tokens
        assert len(r.tokens) > 20 and (r.finish_reason == "length" or r.tokens[-1] in (1, 4))
        assert set(r.tokens[20:-1]).isdisjoint({1, 4})


def test_batch_independence_and_mixed_prompt_lengths():
    """A request's tokens do not depend on its neighbours (counter-based draws, per-row masks).
    float64 so that BLAS blocking differences between batch sizes cannot flip a near-tie."""
    model = build_tiny(torch.float64)
    no_end(model)
    reqs = [
        Request(prompt_ids=list(range(2, 2 + n)), max_tokens=20, sampler=FIXED, seed=3, request_id=i)
        for i, n in enumerate((1, 9, 4, 15))
    ]
    together = run(model, reqs)
    for i, r in enumerate(reqs):
        alone = run(model, [r])[0]
        assert alone.tokens == together[i].tokens


def test_continuous_batching_joins_at_canvas_boundary():
    """A request submitted while another is mid-canvas gets the same result as when run alone."""
    model = build_tiny(torch.float64)
    no_end(model)
    a = Request(prompt_ids=[2, 3, 4], max_tokens=24, sampler=FIXED, seed=1, request_id=1)
    b = Request(prompt_ids=[2, 9], max_tokens=16, sampler=FIXED, seed=2, request_id=2)
    rt = BlockDiffusionRuntime(model, max_batch=2, max_len=128)
    ra = rt.submit(a)
    with torch.no_grad():
        rt.step()
        rt.step()  # a is at step 2 of its first canvas
        rb = rt.submit(b)
        while rt.busy():
            rt.step()
    assert ra.tokens == run(model, [a])[0].tokens
    assert rb.tokens == run(model, [b])[0].tokens
    assert rt.passes["denoise"] < 3 * (3 + 2)  # passes were shared


def test_infill_template_is_respected():
    model = build_tiny()
    no_end(model)
    template = [7, -1, 7, -1, -1, 9, -1, 10]
    res = run(model, [Request(prompt_ids=[2], max_tokens=16, sampler=FIXED, template=template)])[0]
    for canvas in (res.tokens[:8], res.tokens[8:]):
        assert [t for t, p in zip(canvas, template, strict=True) if p >= 0] == [7, 7, 9, 10]


def test_cancellation_between_steps():
    model = build_tiny()
    no_end(model)
    rt = BlockDiffusionRuntime(model, max_batch=2, max_len=128)
    keep = rt.submit(Request(prompt_ids=[2], max_tokens=16, sampler=FIXED, request_id=1))
    gone = rt.submit(Request(prompt_ids=[2], max_tokens=16, sampler=FIXED, request_id=2))
    with torch.no_grad():
        rt.step()
        rt.cancel(2)
        while rt.busy():
            rt.step()
    assert gone.finish_reason == "cancelled" and len(gone.tokens) == 0
    assert keep.finish_reason == "length" and len(keep.tokens) == 16


@pytest.mark.parametrize(
    "req, message",
    [
        (Request(prompt_ids=[]), "prompt is empty"),
        (Request(prompt_ids=[2], max_tokens=0), "max_tokens must be >= 1"),
        (Request(prompt_ids=[2] * 200), "exceeds the context limit"),
        (Request(prompt_ids=[2, 99]), "outside the vocabulary"),
        (Request(prompt_ids=[2, -1]), "outside the vocabulary"),  # a negative id would index from the end
        (Request(prompt_ids=[2], template=[1] * 9), "infill template"),
    ],
)
def test_bad_requests_are_refused(req, message):
    rt = BlockDiffusionRuntime(build_tiny(), max_batch=1, max_len=128)
    with pytest.raises(InputError, match=message):
        rt.submit(req)


class RecordingBackend(TorchBackend):
    """Records which rows got a self-conditioning signal; `zeros` restores the old all-zero first step."""

    def __init__(self, model, zeros: bool = False) -> None:
        super().__init__(model)
        self.zeros, self.calls = zeros, []

    def denoise_step(self, canvas, sc_soft, positions, masks, past, sampler, need_soft=True):
        self.calls.append(None if sc_soft is None else bool(sc_soft.abs().sum(dim=(1, 2)).gt(0).all()))
        if sc_soft is None and self.zeros:
            sc_soft = torch.zeros(*canvas.shape, self.config.text_config.hidden_size, dtype=self.dtype)
        return super().denoise_step(canvas, sc_soft, positions, masks, past, sampler, need_soft)


def test_first_step_passes_no_self_conditioning_signal():
    """A batch of fresh canvases passes None (the network skips probs @ E); a batch mixing fresh and running
    canvases zeroes the fresh rows; both give exactly the tokens of an all-zero signal."""
    model = build_tiny()
    no_end(model)
    short = SamplerConfig(max_denoising_steps=2, confidence_threshold=0.0)
    reqs = [  # the second finishes a step before the first: the third joins it mid-canvas
        Request(prompt_ids=[2, 5, 6], max_tokens=t, sampler=c, seed=1, request_id=i)
        for i, (t, c) in enumerate(((16, FIXED), (8, short), (16, FIXED)))
    ]
    skip, zeros = RecordingBackend(model), RecordingBackend(model, zeros=True)
    a = BlockDiffusionRuntime(skip, max_batch=2, max_len=128).generate(reqs)
    b = BlockDiffusionRuntime(zeros, max_batch=2, max_len=128).generate(reqs)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert skip.calls[:2] == [None, True]  # the first canvases' first and second steps
    assert False in skip.calls  # the third request's first step, beside the first one's third


def test_a_slots_previous_occupant_cannot_leak_non_finite_signal():
    """A fresh row beside a running one gets exactly no signal, even when the slot's last occupant left
    NaN/inf behind (a multiply by a 0/1 mask would keep the NaN: every later request in the slot failed)."""
    from types import SimpleNamespace

    rt = BlockDiffusionRuntime(build_tiny(), max_batch=2, max_len=64)
    rt.sc = torch.full((2, 3, 4), float("nan"))
    rt.sc[1] = 0.25
    rt.has_sc = [False, True]  # slot 0 starts a canvas, slot 1 is mid-canvas
    rows = rt._sc_input(SimpleNamespace(slot_list=[0, 1], slots=torch.tensor([0, 1])))
    assert torch.equal(rows[0], torch.zeros(3, 4)) and torch.equal(rows[1], torch.full((3, 4), 0.25))


def test_self_conditioning_state_is_hidden_wide_in_the_model_dtype():
    """The runtime keeps softmax(z) @ E * sqrt(d) per position ([slots, canvas, hidden]), never the
    [slots, canvas, vocab] probabilities, and it is exactly what the network's soft_embedding gives."""
    model = build_tiny(torch.float64)
    no_end(model)
    rt = BlockDiffusionRuntime(model, max_batch=2, max_len=64)
    cfg = model.config
    assert rt.sc.shape == (2, cfg.canvas_length, cfg.text_config.hidden_size)
    assert rt.sc.dtype == torch.float64
    seen = []
    backend = rt.backend
    step = backend.denoise_step

    def record(*args, **kwargs):
        res = step(*args, **kwargs)
        seen.append((res.step.probs.clone(), res.soft))  # probs live until the next step (a reused buffer)
        return res

    backend.denoise_step = record
    fixed = SamplerConfig(max_denoising_steps=3, confidence_threshold=0.0)
    rt.generate([Request(prompt_ids=[2, 5, 6], max_tokens=cfg.canvas_length, sampler=fixed)])
    assert len(seen) == 3
    assert [soft is None for _, soft in seen] == [False, False, True]  # the canvas's last pass: none read
    for probs, soft in seen[:2]:
        assert torch.equal(soft, model.soft_embedding(probs))
    assert torch.equal(rt.sc[0], seen[1][1][0])


class AlwaysSoftBackend(TorchBackend):
    """The PyTorch backend told to compute the self-conditioning input on every pass, and counting the
    passes that were told it is not needed."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.skipped = 0

    def denoise_step(self, *args, need_soft=True, **kwargs):
        self.skipped += not need_soft
        return super().denoise_step(*args, need_soft=True, **kwargs)


def test_a_canvas_last_pass_skips_the_self_conditioning_input_and_no_token_changes():
    """Rows with different step limits share passes: the input is skipped only on a pass after which no
    row steps again, and the tokens are those of a runtime that computes it on every pass."""
    model = build_tiny()
    no_end(model)
    reqs = lambda: [
        Request([2, 5, 6], max_tokens=2 * model.config.canvas_length, seed=1,
                sampler=SamplerConfig(max_denoising_steps=3, confidence_threshold=0.0)),
        Request([2, 7], max_tokens=model.config.canvas_length, seed=2,
                sampler=SamplerConfig(max_denoising_steps=2, confidence_threshold=0.0)),
    ]  # fmt: skip
    rt = BlockDiffusionRuntime(model, max_batch=2, max_len=64)
    calls = []
    step = rt.backend.denoise_step
    rt.backend.denoise_step = lambda *a, need_soft=True, **k: (
        calls.append(need_soft) or step(*a, need_soft=need_soft, **k)
    )
    got = rt.generate(reqs())
    # canvas 1: passes 1-2 hold both rows (row 2 ends at 2), pass 3 ends row 1; canvas 2: row 1 alone, 3 passes
    assert calls == [True, True, False, True, True, False]
    always = AlwaysSoftBackend(model)
    want = BlockDiffusionRuntime(always, max_batch=2, max_len=64).generate(reqs())
    assert always.skipped == 2
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_a_row_stops_on_length_when_the_next_canvas_no_longer_fits_the_context():
    """A request asking for more tokens than its context holds ends with finish_reason "length" after the
    last canvas that fits, instead of failing the whole batch with a KV-cache overflow: a user who sets
    max_tokens above the server's context gets a truncated reply, not an error."""
    model = build_tiny()
    no_end(model)
    res = run(model, [Request(prompt_ids=[2, 5, 6], max_tokens=100, sampler=FIXED)], max_len=40)[0]
    assert res.finish_reason == "length"
    # 3 prompt tokens + 4 committed canvases of 8 = 35 <= 40; a fifth canvas (35..42) would not fit
    assert len(res.tokens) == 32 and len(res.steps_per_canvas) == 4


@pytest.mark.parametrize(("prompt", "room"), [(1, 32), (3, 32), (8, 32), (9, 24), (31, 8), (32, 8)])
def test_guide_room_counts_the_whole_canvases_the_context_holds(prompt, room):
    """guide_room (what a guided request's min_tokens is checked against) is exactly what the runtime then
    emits: whole canvases only, a partial one not rounded up. Over-counting it admitted guides whose
    shortest output cannot fit, which then ended unfinished instead of being refused up front."""
    model = build_tiny()
    no_end(model)
    rt = BlockDiffusionRuntime(model, max_batch=1, max_len=40)
    req = Request(prompt_ids=[2] * prompt, max_tokens=999, sampler=FIXED)
    assert rt.guide_room(req) == room
    assert rt.guide_room(Request(prompt_ids=[2] * prompt, max_tokens=5)) == 5  # max_tokens when smaller
    res = rt.generate([req])[0]
    assert res.finish_reason == "length" and len(res.tokens) == room


END = 1


@pytest.mark.parametrize(
    ("block", "floor", "room", "emitted", "reason"),
    [
        ([5, 6, END, 7], 0, 10, [5, 6, END], "stop"),  # cut after the first end token
        ([5, END, 6, END], 2, 10, [5, END, 6, END], "stop"),  # an end token before min_tokens is a token
        ([5, END, 6], 2, 10, [5, END, 6], ""),  # ... and the request goes on
        ([5, 6, 7, END], 0, 2, [5, 6], "length"),  # max_tokens cuts before the end token
        ([5, 6, END], 0, 3, [5, 6, END], "stop"),  # the end token is the last one max_tokens allows
        ([5, 6, 7], 0, 3, [5, 6, 7], "length"),  # max_tokens reached exactly
        ([5, 6, 7], 0, 4, [5, 6, 7], ""),
    ],
)
def test_a_finished_canvas_is_cut_at_its_first_allowed_end_token_and_at_max_tokens(
    block, floor, room, emitted, reason
):
    assert emitted_tokens(block, {END}, floor, room) == (emitted, reason)
