"""The PyTorch sampler (the oracle for the CUDA kernels) against transformers' sampler pieces and by hand."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import SamplerError
from pipeline.model.config import SamplerConfig
from pipeline.sampler import rng
from pipeline.sampler.reference import (
    CounterDraws,
    RowKeys,
    entropy_bound_keep,
    mask_logits,
    masked_logit,
    sample_step,
    should_stop,
    temperatures,
    update_stability,
)


def keys(b: int, seed: int = 7, request: int = 0, canvas: int = 0, step: int = 0) -> RowKeys:
    t = lambda v: torch.full((b,), v, dtype=torch.long)
    return RowKeys(t(seed), torch.arange(request, request + b), t(canvas), t(step))


def test_entropy_bound_by_hand():
    h = torch.tensor([[0.30, 0.01, 0.05, 0.90, 0.02]])
    # sorted: .01 .02 .05 .30 .90 -> cumsum - h: 0 .01 .03 .08 .38 -> keep the first four for bound .1
    assert entropy_bound_keep(h, torch.tensor([0.1])).tolist() == [[True, True, True, False, True]]
    # a tiny bound still keeps the lowest-entropy position
    assert entropy_bound_keep(h, torch.tensor([1e-9])).tolist() == [[False, True, False, False, False]]


def test_entropy_bound_matches_transformers():
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(4, 64, 50, generator=g)
    sampler = gen.EntropyBoundSampler(gen.EntropyBoundSamplerConfig(entropy_bound=0.7), 64, 50, 10)
    current = torch.randint(0, 50, (4, 64), generator=g)
    proposal = torch.randint(0, 50, (4, 64), generator=g)
    accepted = sampler.accept_canvas(current, proposal, logits, 3)
    ent = -(torch.log_softmax(logits, -1).exp() * torch.log_softmax(logits, -1)).sum(-1)
    ours = entropy_bound_keep(ent, torch.full((4,), 0.7))
    assert torch.equal(ours, sampler.accepted_token_mask)
    assert torch.equal(torch.where(ours, proposal, current), accepted)


def test_stability_matches_transformers():
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    g = torch.Generator().manual_seed(1)
    for k in (0, 1, 2):
        ref = gen.StableAndConfidentStoppingCriteria(stability_threshold=k, confidence_threshold=2.0)
        count = torch.zeros(3, dtype=torch.long)
        prev = torch.full((3, 8), -1)
        base = torch.randint(0, 9, (3, 8), generator=g)
        for step in range(6):
            amax = base.clone()
            amax[0, 0] = step  # row 0 keeps changing, rows 1-2 are constant
            logits = torch.randn(3, 8, 9, generator=g) * (1 + step)
            ent = torch.distributions.Categorical(logits=logits).entropy()
            count = update_stability(count, prev, amax)
            prev = amax
            ours = should_stop(count, torch.full((3,), k), ent, torch.full((3,), 2.0))
            assert torch.equal(ours, ref(amax, logits)), (k, step)


@pytest.mark.parametrize(
    ("t_min", "t_max", "n"), [(0.4, 0.8, 48), (0.2, 1.0, 16), (0.1, 0.7, 128), (0.3, 0.9, 7)]
)
def test_temperature_schedule_matches_transformers_bit_for_bit(t_min, t_max, n):
    """The fp32 logits are divided by the very temperature transformers divides them by (its processor
    takes the step as an int32 tensor, as its generate loop passes it): one ulp apart, a position at the
    entropy bound's edge may be kept by one and not the other."""
    gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    proc = gen.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=n)
    logits = torch.linspace(-30, 30, 1001)
    steps = torch.arange(n)
    ours = temperatures(steps, torch.full((n,), n), torch.full((n,), t_min), torch.full((n,), t_max - t_min))
    for step in range(n):
        ref = proc(None, logits, cur_step=torch.tensor(n - step, dtype=torch.int32))
        assert torch.equal(logits / ours[step], ref), step
        assert SamplerConfig(t_min=t_min, t_max=t_max, max_denoising_steps=n).temperature(
            step
        ) == pytest.approx(ours[step].item(), rel=1e-6)


def test_counter_rng_is_stateless_and_keyed():
    d = CounterDraws()
    a = d.initial_canvas(keys(3), 256, 262_144)
    assert torch.equal(a, d.initial_canvas(keys(3), 256, 262_144))
    # row r of a batch equals the same request alone: draws do not depend on the batch
    assert torch.equal(a[1:2], d.initial_canvas(keys(1, request=1), 256, 262_144))
    assert not torch.equal(a, d.initial_canvas(keys(3, step=1), 256, 262_144))
    assert not torch.equal(a, d.renoise(keys(3), 256, 262_144))
    assert a.min() >= 0 and a.max() < 262_144
    # roughly uniform: every decile of the vocabulary gets 10% +- 2%
    counts = torch.bincount((d.initial_canvas(keys(64), 256, 1000) // 100).flatten(), minlength=10)
    assert (counts.float() / counts.sum() - 0.1).abs().max() < 0.02


def test_gumbel_max_samples_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = probs.log().expand(1, 4000, 4)
    tok = CounterDraws().categorical(keys(1), z)
    freq = torch.bincount(tok.flatten(), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.025)


def test_known_hash_values():
    """Pinned values: the CUDA kernel implements the same function and is checked against these."""
    k = rng.key_hash(
        torch.tensor([1]), torch.tensor([2]), torch.tensor([3]), torch.tensor([4]), rng.STREAM_SAMPLE
    )
    assert int(rng.fmix32(torch.tensor([0x12345678]))) == 0xE37CD1BC  # murmur3 fmix32 reference value
    assert int(k) == 501821951
    assert rng.uniform_tokens(k, 4, 262_144).tolist() == [[16715, 119477, 58320, 55430]]


def test_template_positions_are_pinned_and_free():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 10, 30, generator=g)
    tpl = torch.full((2, 10), -1)
    tpl[:, ::3] = 7
    out = sample_step(logits, torch.ones(2), torch.full((2,), 0.5), keys(2), CounterDraws(), tpl)
    assert (out.canvas[:, ::3] == 7).all() and (out.argmax[:, ::3] == 7).all()
    assert (out.entropy[:, ::3] == 0).all() and out.kept[:, ::3].all()


@pytest.mark.parametrize(
    "bad",
    [
        {"entropy_bound": 0.0},
        {"max_denoising_steps": 0},
        {"t_min": 0.9, "t_max": 0.5},
        {"confidence_threshold": -1.0},
    ],
)
def test_invalid_sampler_values(bad):
    with pytest.raises(SamplerError) as e:
        SamplerConfig(**bad)
    assert next(iter(bad)) in str(e.value)


def test_free_positions_are_not_masked_and_constrained_ones_are():
    """index -1 marks a position no guide constrains (an unguided row, or a guided row's free tail): its
    logits must reach the sampler untouched, or an unguided request sharing a batch with a guided one would
    lose tokens; a constrained position keeps exactly its table row's tokens."""
    logits = torch.arange(12, dtype=torch.float32).reshape(1, 2, 6) - 5.0
    table = torch.tensor([[True, False, True, False, False, False], [False] * 5 + [True]])
    assert torch.equal(mask_logits(logits, table, torch.full((1, 2), -1)), logits)
    out = mask_logits(logits, table, torch.tensor([[-1, 1]]))
    assert torch.equal(out[0, 0], logits[0, 0])
    assert torch.equal(out[0, 1], torch.tensor([masked_logit(torch.float32)] * 5 + [6.0]))


def test_masked_fp16_logits_survive_a_temperature_below_one():
    """A disallowed token's logit is a quarter of fp16's range (-16376), so dividing it by a temperature
    down to 0.25 in fp16 stays finite: at -inf the entropy's 0 * log 0 is NaN, and a NaN entropy breaks the
    entropy-bound acceptance of the whole row (a guided request on an fp16 model at T=0.4)."""
    assert masked_logit(torch.float16) == -16376.0
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 6, generator=g).half()
    table = torch.tensor([[True, True, False, False, False, False]])
    masked = mask_logits(logits, table, torch.tensor([[0, 0, -1, 0]]))
    assert torch.isfinite(masked / torch.tensor(0.4, dtype=torch.float16)).all()
    temperature = torch.tensor([0.4], dtype=torch.float16)
    out = sample_step(masked, temperature, torch.full((1,), 0.5), keys(1), CounterDraws())
    assert torch.isfinite(out.entropy).all() and (out.entropy >= 0).all()
    assert out.argmax[0, [0, 1, 3]].lt(2).all()  # a constrained position's argmax is an allowed token
    assert (out.probs[0, [0, 1, 3], 2:] == 0).all()


def test_entropy_bound_keeps_a_position_exactly_at_the_bound():
    """The rule is `sum of the lower entropies <= bound`: a position whose budget lands exactly on the bound is
    kept (EB-sampler and transformers' sampler agree), so an equal-entropy canvas is not re-noised one step
    longer than the reference. Binary fractions: the sums are exact."""
    h = torch.tensor([[0.5, 0.125, 0.25, 1.0]])
    # sorted .125 .25 .5 1 -> cumsum - h: 0 .125 .375 .875
    assert entropy_bound_keep(h, torch.tensor([0.375])).tolist() == [[True, True, True, False]]
    assert entropy_bound_keep(h, torch.tensor([0.125])).tolist() == [[False, True, True, False]]


def test_confidence_threshold_zero_never_stops_early():
    """confidence_threshold 0 means fixed steps: the stop needs mean entropy strictly below it, so even a
    stable canvas at entropy exactly 0 (a fully pinned template, a one-hot model) runs every step the user
    asked for; a positive threshold does stop it."""
    stable, k, zero = torch.tensor([5]), torch.tensor([1]), torch.zeros(1, 8)
    assert should_stop(stable, k, zero, torch.tensor([0.0])).tolist() == [False]
    assert should_stop(stable, k, zero, torch.tensor([0.5])).tolist() == [True]
    assert should_stop(torch.tensor([0]), k, zero, torch.tensor([0.5])).tolist() == [False]  # not yet stable


def test_seeds_that_differ_above_bit_31_draw_apart():
    """The API takes 63-bit seeds: 1 and 1 + 2**32 are two seeds, not one; a seed under 2**32 keeps the key
    it had as a 32-bit one (the pinned values above)."""

    def one(seed: int, n: int) -> torch.Tensor:
        words = (torch.full((n,), w) for w in (seed, 2, 3, 4))
        return rng.key_hash(*words, rng.STREAM_SAMPLE)

    for rows in (1, rng.HOST_KEY_ROWS + 1):  # the host form and the tensor form
        seeds = [1, 1 + 2**32, 1 + 2**40, 2**63 - 1, 2**32 - 1]
        keys = [int(one(s, rows)[0]) for s in seeds]
        assert keys[0] == 501821951 and len(set(keys)) == len(seeds), keys
