"""The fused CUDA sampler against the PyTorch sampler (the oracle), on a GPU.

Same inputs to both; outputs poisoned before each kernel run so nothing passes by leftover values.
Required: identical sampled tokens, argmax, kept sets, next canvas, stability counts and stop flags;
entropies within 1e-5 relative (plus 1.1e-6 absolute: an fp32 log-softmax over the real vocabulary is only
that good near zero entropy) of both the oracle and a float64 computation; bf16 softmax within bf16 rounding.

The oracle runs on the GPU too: its Gumbel noise then goes through the same CUDA `logf` as the kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pipeline.sampler.reference import (
    CounterDraws,
    RowKeys,
    StepOutput,
    conditioning_softmax,
    sample_step,
    should_stop,
    temperatures,
    update_stability,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

DEVICE = "cuda"
VOCAB, CANVAS = 262_144, 256
# ATOL: an fp32 log-sum-exp over V = 262,144 terms is only good to about log2(V) * 2^-24 ~ 1.1e-6 absolute,
# which decides near-zero entropies (H200, torch 2.11: errors up to 7.2e-7 measured on these cases,
# the PyTorch oracle itself up to 3.9e-7 off)
ENTROPY_RTOL, ENTROPY_ATOL = 1e-5, 1.1e-6
SC_RTOL = 2**-8 + 1e-5  # bf16 rounding (relative 2^-8 at most) and a few fp32 ulps of the softmax


def worst(
    ours: torch.Tensor, truth: torch.Tensor, oracle: torch.Tensor, bound: torch.Tensor, n: int = 5
) -> str:
    """The positions furthest past their bound, as (float64 truth, kernel, oracle, |kernel - truth|, bound)."""
    excess = ((ours - truth).abs() - bound).flatten()
    idx = excess.topk(min(n, excess.numel())).indices
    rows = [
        f"truth {truth.flatten()[i]:.9g} kernel {ours.flatten()[i]:.9g} oracle {oracle.flatten()[i]:.9g} "
        f"err {(ours - truth).abs().flatten()[i]:.3g} bound {bound.flatten()[i]:.3g}"
        for i in idx.tolist()
    ]
    return "; ".join(rows)


def sample_step_cuda(*args, **kwargs):  # indirection: lets the harness be dry-run against a stand-in
    from pipeline.sampler.kernels.gpu_sampler import sample_step_cuda as impl

    return impl(*args, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def extension():
    """Build the extension once, up front, so a build failure reads as one clear error (a tool missing for
    the build, nvcc or ninja, skips the module naming it)."""
    from pipeline.sampler.kernels.build import load_torch_extension, missing_build_tools

    missing = missing_build_tools()
    if missing is not None:
        pytest.skip(str(missing))
    return load_torch_extension()


@dataclass
class Case:
    logits: torch.Tensor
    temperature: torch.Tensor
    bound: torch.Tensor
    keys: RowKeys
    template: torch.Tensor | None
    stable_in: torch.Tensor
    stab_k: torch.Tensor


def make_case(
    batch: int, length: int, vocab: int, dtype: torch.dtype, seed: int, infill: bool = False
) -> Case:
    """Softcapped random logits whose sharpness varies per position (near-uniform to near-one-hot), so the
    entropies span a wide range and the kept sets are neither empty nor everything."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.logspace(-0.5, 1.7, length, device=DEVICE)
    scale = scale[torch.randperm(length, generator=gen, device=DEVICE)]
    logits = torch.randn(batch, length, vocab, generator=gen, device=DEVICE) * scale[None, :, None]
    peaked = torch.rand(batch, length, generator=gen, device=DEVICE) < 0.3  # a spike on one token
    spike = torch.randint(0, vocab, (batch, length, 1), generator=gen, device=DEVICE)
    logits.scatter_add_(-1, spike, (peaked * 25.0)[..., None])
    logits = (30 * torch.tanh(logits / 30)).to(dtype)
    ids = torch.arange(batch, device=DEVICE)
    keys = RowKeys(seed=ids * 1000 + seed, request=ids + 17, canvas=ids % 3, step=ids % 16)
    n_steps = torch.full_like(ids, 16)
    # the schedule from t_max 0.8 to t_min 0.4: temperatures takes t_min and the span
    temp = temperatures(
        keys.step,
        n_steps,
        torch.full((batch,), 0.4, device=DEVICE),
        torch.full((batch,), 0.8 - 0.4, device=DEVICE),
    )
    bound = torch.tensor([0.1, 1.0, 10.0, 1e-6], device=DEVICE).repeat(batch)[:batch]
    template = None
    if infill:
        template = torch.full((batch, length), -1, dtype=torch.long, device=DEVICE)
        pinned = torch.rand(batch, length, generator=gen, device=DEVICE) < 0.25
        pinned[:, :8] = True  # a pinned prefix, as a prompt-in-canvas would be
        template[pinned] = torch.randint(0, vocab, (int(pinned.sum()),), generator=gen, device=DEVICE)
    return Case(
        logits=logits,
        temperature=temp,
        bound=bound,
        keys=keys,
        template=template,
        stable_in=ids % 3,
        stab_k=ids % 3 + 1,
    )


def poisoned_buffers(batch: int, length: int, vocab: int, float_poison: float = float("nan")):
    """Step buffers holding values no kernel writes. `float_poison`: finite where a test expects NaN outputs
    (a NaN left in place would pass for one written)."""
    from pipeline.sampler.kernels.gpu_sampler import StepBuffers

    buf = StepBuffers.allocate(batch, length, vocab, DEVICE)
    for t in (buf.entropy, buf.max_prob, buf.probs):
        t.fill_(float_poison)
    for t in (buf.argmax, buf.sample, buf.canvas, buf.stable):
        t.fill_(-1)
    for t in (buf.kept, buf.stop):
        t.view(torch.uint8).fill_(0xAA)  # neither True (1) nor False (0)
    return buf


def float64_truth(z: torch.Tensor, template: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and max probability of the same fp32 z in float64, row by row (no [B, L, V] float64)."""
    entropy = torch.empty(z.shape[:2], dtype=torch.float64, device=z.device)
    max_prob = torch.empty_like(entropy)
    for b in range(z.shape[0]):
        lp = torch.log_softmax(z[b].double(), dim=-1)
        entropy[b] = -(lp.exp() * lp).sum(-1)
        max_prob[b] = lp.amax(-1).exp()
    return (entropy if template is None else entropy.masked_fill(template >= 0, 0.0)), max_prob


def stable_keep(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`entropy_bound_keep` with ties in entropy broken by position, as the kernel does. (torch.sort
    without stable=True is not stable on CPU past 16 elements, so the oracle's order among exactly equal
    entropies is unspecified; it only matters when such a tie straddles the bound.)"""
    sorted_h, order = torch.sort(entropy, dim=-1, stable=True)
    keep_sorted = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound[:, None]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def check_step(case: Case, conf_scale: tuple[float, float] = (0.99, 1.01), ties: bool = False) -> StepOutput:
    """Run oracle and kernels on one case and compare everything; returns the kernel's step output.
    `ties`: entropies tie exactly across positions, so the kept set is checked against the stable rule
    rather than the oracle's (unspecified) order among equal entropies."""
    batch, length, vocab = case.logits.shape
    draws = CounterDraws()
    ref = sample_step(case.logits, case.temperature, case.bound, case.keys, draws, case.template)
    z = case.logits / case.temperature[:, None, None]
    ref_sample = draws.categorical(case.keys, z)
    # previous argmax canvas: equal to this step's on even rows, one token off on odd rows
    prev = ref.argmax.clone()
    prev[1::2, length // 2] = (prev[1::2, length // 2] + 1) % vocab
    ref_count = update_stability(case.stable_in, prev, ref.argmax)
    # confidence threshold 1% under / over the mean entropy: both stop outcomes, far from rounding
    mean = ref.entropy.double().mean(-1)
    conf = (mean * torch.tensor(conf_scale, device=DEVICE, dtype=torch.float64).repeat(batch)[:batch]).float()
    ref_stop = should_stop(ref_count, case.stab_k, ref.entropy, conf)

    buf = poisoned_buffers(batch, length, vocab)
    out, count, stop = sample_step_cuda(
        case.logits,
        case.temperature,
        case.bound,
        case.keys,
        case.template,
        prev,
        case.stable_in,
        case.stab_k,
        conf,
        out=buf,
    )

    # every output written (no poison left)
    assert torch.isfinite(buf.entropy).all() and torch.isfinite(buf.max_prob).all()
    assert torch.isfinite(buf.probs).all()
    for t in (buf.argmax, buf.sample, buf.canvas, buf.stable):
        assert (t >= 0).all()
    for t in (buf.kept, buf.stop):
        assert (t.view(torch.uint8) <= 1).all()

    # bit-exact parts
    assert torch.equal(buf.sample, ref_sample), "Gumbel-max samples differ"
    assert torch.equal(out.argmax, ref.argmax), "argmax canvas differs"
    if not ties:
        assert torch.equal(out.kept, ref.kept), "kept sets differ"
        assert torch.equal(out.canvas, ref.canvas), "next canvas differs"
    assert torch.equal(count, ref_count) and torch.equal(stop, ref_stop), "stability / stop differ"
    # the keep rule on the kernel's own entropies, on CPU (double-accumulated cumsum, stable order)
    assert torch.equal(out.kept.cpu(), stable_keep(out.entropy.cpu(), case.bound.cpu()))
    noise = draws.renoise(case.keys, length, vocab)
    expected = torch.where(out.kept, ref_sample, noise)
    if case.template is not None:
        expected = torch.where(case.template >= 0, case.template, expected)
    assert torch.equal(out.canvas, expected), "next canvas is not kept ? sample : re-noise"

    # entropies: close to float64 truth, and to the oracle within the oracle's own error
    truth, truth_max_prob = float64_truth(z, case.template)
    ours, oracle = out.entropy.double(), ref.entropy.double()
    bound = ENTROPY_RTOL * truth + ENTROPY_ATOL
    assert ((ours - truth).abs() <= bound).all(), "entropy vs float64: " + worst(ours, truth, oracle, bound)
    allowed = ENTROPY_RTOL * oracle.abs() + ENTROPY_ATOL + (oracle - truth).abs()
    assert ((ours - oracle).abs() <= allowed).all(), "entropy vs oracle"
    torch.testing.assert_close(buf.max_prob.double(), truth_max_prob, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(buf.max_prob, ref.probs.amax(-1), rtol=1e-4, atol=1e-7)
    # a bf16 model's self-conditioning probabilities, softmax(bf16(z)): within bf16 rounding of the oracle's
    # (the rounding alone reaches 0.0038910 of the 2^-8 = 0.0039063; SC_RTOL leaves fp32's ulps room)
    sc = conditioning_softmax(z, torch.bfloat16)
    for b in range(batch):
        torch.testing.assert_close(out.probs[b].float(), sc[b], rtol=SC_RTOL, atol=1e-37)
    if case.template is not None:
        pinned = case.template >= 0
        assert torch.equal(out.canvas[pinned], case.template[pinned])
        assert torch.equal(out.argmax[pinned], case.template[pinned])
        assert (out.entropy[pinned] == 0).all()
    if length > 1:
        assert 0.0 < out.kept.float().mean().item() < 1.0, "degenerate case: every position kept or none"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_real_vocab_matches_oracle(batch: int, dtype: torch.dtype):
    check_step(make_case(batch, CANVAS, VOCAB, dtype, seed=batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_infill_template_matches_oracle(dtype: torch.dtype):
    check_step(make_case(4, CANVAS, VOCAB, dtype, seed=11, infill=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("length", "vocab"), [(37, 1003), (1024, 4096), (1, 64)])
def test_odd_shapes_scalar_path_and_max_canvas(length: int, vocab: int, dtype: torch.dtype):
    """Vocabularies that are not a multiple of the vector width take the scalar kernel; a 1024 canvas
    fills kernel B's block; non-power-of-two canvases exercise the sort's padding."""
    check_step(make_case(3, length, vocab, dtype, seed=length, infill=length > 1))


def test_misaligned_logits_take_the_scalar_path():
    case = make_case(2, 64, 4096, torch.float32, seed=5)
    storage = torch.empty(case.logits.numel() + 1, device=DEVICE)
    case.logits = storage[1:].view_as(case.logits).copy_(case.logits)  # 4-byte, not 16-byte, aligned
    check_step(case)


def test_ties_go_to_the_lowest_index():
    """Equal logits: argmax and Gumbel ties to the lowest index; equal entropies: kept by index order."""
    batch, length, vocab = 2, 64, 4096
    case = make_case(batch, length, vocab, torch.float32, seed=3)
    row = case.logits[:, :1].clone()
    row[..., 100] = row[..., 200] = row.amax(-1) + 1.0  # two equal maxima
    case.logits = row.expand(batch, length, vocab).contiguous()  # every position identical
    h = sample_step(case.logits, case.temperature, case.bound, case.keys, CounterDraws()).entropy[:, 0]
    case.bound = h * 10.5  # keeps exactly 11 positions of equal entropy: which ones is the tie-break
    out = check_step(case, ties=True)
    assert (out.argmax == 100).all()
    assert out.kept[:, :11].all() and not out.kept[:, 11:].any()


def test_a_short_denoise_loop_matches_oracle():
    """Several steps feeding the kernel's canvas, argmax and stability count back in."""
    batch, length, vocab = 4, 128, 8192
    from pipeline.sampler.kernels.gpu_sampler import sample_step_cuda as impl

    gen = torch.Generator(device=DEVICE).manual_seed(9)
    base = 30 * torch.tanh(torch.randn(batch, length, vocab, generator=gen, device=DEVICE) * 8 / 30)
    ids = torch.arange(batch, device=DEVICE)
    prev_k = torch.full((batch, length), -1, dtype=torch.long, device=DEVICE)
    prev_r = prev_k.clone()
    count_k = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    count_r = count_k.clone()
    stab_k = torch.ones(batch, dtype=torch.long, device=DEVICE)
    conf = torch.full((batch,), 50.0, device=DEVICE)
    for step in range(4):
        logits = base if step >= 2 else base + torch.randn(base.shape, generator=gen, device=DEVICE)
        keys = RowKeys(ids + 1, ids, torch.zeros_like(ids), torch.full_like(ids, step))
        temp = torch.full((batch,), 0.5, device=DEVICE)
        bound = torch.full((batch,), 0.5, device=DEVICE)
        out, count_k, stop_k = impl(logits, temp, bound, keys, None, prev_k, count_k, stab_k, conf)
        ref = sample_step(logits, temp, bound, keys, CounterDraws(), None)
        count_r = update_stability(count_r, prev_r, ref.argmax)
        stop_r = should_stop(count_r, stab_k, ref.entropy, conf)
        assert torch.equal(out.canvas, ref.canvas) and torch.equal(out.argmax, ref.argmax), step
        assert torch.equal(count_k, count_r) and torch.equal(stop_k, stop_r), step
        prev_k, prev_r = out.argmax.clone(), ref.argmax
    assert count_r.tolist() == [1] * batch and stop_r.all()  # steps 2 and 3 saw the same logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_constraint_masks_inside_the_kernel_equal_masking_the_logits(dtype: torch.dtype):
    """Constrained decoding's compact masks (table [M, V] + index [B, L], -1 = free) read by kernel A give
    exactly what masking the logits first gives, and that matches the oracle on the masked logits."""
    import dataclasses

    from pipeline.sampler.reference import mask_logits

    batch = 4
    case = make_case(batch, CANVAS, VOCAB, dtype, seed=21)
    gen = torch.Generator(device=DEVICE).manual_seed(21)
    table = torch.rand(3, VOCAB, generator=gen, device=DEVICE) < 0.01
    table[:, 7] = True  # never an empty set
    index = torch.randint(-1, 3, (batch, CANVAS), generator=gen, device=DEVICE)
    masked = mask_logits(case.logits, table, index)
    check_step(dataclasses.replace(case, logits=masked))  # kernels vs oracle on the masked logits
    prev = torch.full((batch, CANVAS), -1, dtype=torch.long, device=DEVICE)
    args = (case.temperature, case.bound, case.keys, None, prev, case.stable_in, case.stab_k, 0.0)
    first, c1, s1 = sample_step_cuda(masked, *args, out=poisoned_buffers(batch, CANVAS, VOCAB))
    second, c2, s2 = sample_step_cuda(
        case.logits, *args, out=poisoned_buffers(batch, CANVAS, VOCAB), allowed=(table, index)
    )
    for name in ("canvas", "argmax", "entropy", "kept", "probs"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert torch.equal(c1, c2) and torch.equal(s1, s2)
    free = index < 0
    rows_allowed = table[index.clamp(min=0)].gather(-1, second.argmax[..., None])[..., 0]
    assert (rows_allowed | free).all()  # every constrained argmax is an allowed token


def test_a_row_masked_to_one_token_at_a_large_vocab_has_zero_entropy():
    """Constrained to one token out of 2^20 at the lowest temperature: the masked tokens' partial softmax
    sums, merged into the allowed token's, underflow to weight 0 while their entropy term (-1e30 / T times
    half the vocabulary) overflows to -inf; the merge must add nothing, not 0 * -inf. The reference: entropy
    0, probability 1 on the allowed token."""
    vocab, length = 1 << 20, 32
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    logits = (30 * torch.tanh(torch.randn(1, length, vocab, generator=gen, device=DEVICE) / 30)).float()
    table = torch.zeros(1, vocab, dtype=torch.bool, device=DEVICE)
    table[0, 12345] = True
    index = torch.zeros(1, length, dtype=torch.long, device=DEVICE)
    keys = RowKeys(seed=torch.tensor([1], device=DEVICE), request=torch.tensor([2], device=DEVICE),
                   canvas=torch.tensor([0], device=DEVICE), step=torch.tensor([0], device=DEVICE))  # fmt: skip
    prev = torch.full((1, length), -1, dtype=torch.long, device=DEVICE)
    one = torch.ones(1, dtype=torch.long, device=DEVICE)
    args = (
        torch.full((1,), 1e-3, device=DEVICE),
        torch.ones(1, device=DEVICE),
        keys,
        None,
        prev,
        0 * one,
        one,
        0.0,
    )
    out, _, _ = sample_step_cuda(
        logits, *args, out=poisoned_buffers(1, length, vocab), allowed=(table, index)
    )
    assert torch.isfinite(out.entropy).all() and (out.entropy == 0).all()
    assert (out.argmax == 12345).all() and (out.canvas == 12345).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_finite_logits_give_what_the_oracle_gives(dtype: torch.dtype):
    """A broken checkpoint's NaN and infinite logits. NaN: torch's softmax and entropy of the position are
    NaN, its argmax (and the Gumbel argmax) the first NaN. +inf: the same with the first +inf. -inf: the
    entropy NaN (0 * log 0), the softmax not, unless every logit is -inf (then argmax 0). torch.sort puts NaN
    entropies after every number. The kernels give the same, so the kept set and the next canvas still match
    the oracle: every such position re-noised, and a row with one never stops."""
    batch, length, vocab = 2, 64, 4096
    case = make_case(batch, length, vocab, dtype, seed=9)
    nan, inf = float("nan"), float("inf")
    case.logits[0, [3, 40], 123] = nan
    case.logits[0, 17, 5] = case.logits[0, 17, 900] = nan
    case.logits[1, 60] = nan
    case.logits[0, 30, 77] = inf
    case.logits[1, 10, :8] = -inf  # the first chunk of a thread with nothing finite before it
    case.logits[1, 20] = -inf
    nan_at = torch.zeros(batch, length, dtype=torch.bool, device=DEVICE)
    nan_at[0, [3, 17, 30, 40]] = nan_at[1, [10, 20, 60]] = True
    probs_nan = nan_at.clone()
    probs_nan[1, 10] = False  # a few -inf logits: probability 0, the rest finite
    draws = CounterDraws()
    ref = sample_step(case.logits, case.temperature, case.bound, case.keys, draws)
    ref_sample = draws.categorical(case.keys, case.logits / case.temperature[:, None, None])
    prev = ref.argmax.clone()
    ref_count = update_stability(case.stable_in, prev, ref.argmax)
    buf = poisoned_buffers(batch, length, vocab, float_poison=-7.0)
    out, count, stop = sample_step_cuda(
        case.logits, case.temperature, case.bound, case.keys, None, prev, case.stable_in, case.stab_k, 1e9,
        out=buf,
    )  # fmt: skip
    assert torch.equal(ref.entropy.isnan(), nan_at) and torch.equal(out.entropy.isnan(), nan_at)
    assert torch.equal(buf.sample, ref_sample) and torch.equal(out.argmax, ref.argmax)
    assert out.argmax[0, 3] == 123 and out.argmax[0, 17] == 5 and out.argmax[1, 60] == 0
    assert out.argmax[0, 30] == 77 and out.argmax[1, 20] == 0 and buf.sample[1, 20] == 0
    assert torch.equal(out.kept, ref.kept) and torch.equal(out.canvas, ref.canvas)
    assert not out.kept[nan_at].any() and out.kept[~nan_at].any()
    assert torch.equal(count, ref_count) and not stop.any()
    assert torch.equal(out.probs.isnan().all(-1), probs_nan) and not out.probs[~probs_nan].isnan().any()
    sc = conditioning_softmax(case.logits[1, 10] / case.temperature[1], torch.bfloat16)
    torch.testing.assert_close(out.probs[1, 10].float(), sc, rtol=SC_RTOL, atol=1e-37)
    finite = ~probs_nan
    torch.testing.assert_close(buf.max_prob[finite], ref.probs.amax(-1)[finite], rtol=1e-4, atol=1e-7)
