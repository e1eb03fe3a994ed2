"""The CUDA sampler kernels' source against the PyTorch sampler, on the CPU.

`tests/gpu/test_sampler_kernels_cuda.py` holds the compiled kernels to `pipeline.sampler.reference` on a GPU,
which CI does not have; `tests/unit/sampler/test_kernels_build.py` only compiles them. Here dg_sampler.cu's
device code, unchanged, runs on a host emulation of CUDA's execution model (tests/_utils/cuda_emulation) and
is held to the same oracle with the GPU test's bounds: sample, argmax, kept set, next canvas, stability and
stop flag exact; entropy within 1e-5 |H| + 1.1e-6 of float64; the self-conditioning probabilities within bf16
rounding of softmax(bf16(z)). It found a constrained position whose probabilities were all NaN (a thread's
masked first chunk made the self-conditioning sum inf, then inf * 0) before any GPU ran the kernel. What it
cannot show: CUDA's expf/logf ulps, real concurrency, speed (the GPU test and `dgpipe bench gpu` do)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.sampler.reference import (
    CounterDraws,
    RowKeys,
    conditioning_softmax,
    mask_logits,
    sample_step,
    should_stop,
    update_stability,
)
from tests._utils.cuda_emulation import emulate

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="needs g++ (C++20) to build the emulation")

ENTROPY_RTOL, ENTROPY_ATOL = 1e-5, 1.1e-6  # tests/gpu/test_sampler_kernels_cuda.py's bounds
SC_RTOL = 2**-8 + 1e-5


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return emulate.build(tmp_path_factory.mktemp("cuda_emulation"))


def make_case(b: int, length: int, vocab: int, dtype: torch.dtype, seed: int, **extra) -> emulate.Case:
    """Softcapped logits with spread scales and some near-one-hot positions (as the GPU test's)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-0.5, 1.7, length)[torch.randperm(length, generator=g)]
    logits = torch.randn(b, length, vocab, generator=g) * scale[None, :, None]
    spike = torch.randint(0, vocab, (b, length, 1), generator=g)
    logits.scatter_add_(-1, spike, ((torch.rand(b, length, generator=g) < 0.3) * 25.0)[..., None])
    ids = torch.arange(b)
    keys = extra.pop("keys", RowKeys(seed=ids * 1000 + seed, request=ids + 17, canvas=ids % 3, step=ids % 16))
    return emulate.Case(
        logits=(30 * torch.tanh(logits / 30)).to(dtype),
        temperature=extra.pop("temperature", 0.4 + 0.4 * (16 - keys.step).float() / 16),
        keys=keys,
        bound=torch.tensor([0.1, 1.0, 10.0, 1e-6]).repeat(b)[:b],
        prev=torch.zeros(b, length, dtype=torch.long),  # set from the oracle's argmax by `check`
        conf=torch.zeros(b),
        **extra,
    )


def check(
    driver,
    case: emulate.Case,
    tmp_path,
    force_scalar: bool = False,
    changed: torch.Tensor | None = None,
    conf_scale: tuple[float, ...] = (1.01, 0.99),
) -> dict[str, torch.Tensor]:
    """Run the kernels on `case` and hold every output to the oracle; returns the kernels' outputs.
    `changed`: rows whose previous canvas differs from this step's argmax (default: odd rows); `conf_scale`:
    each row's confidence threshold over its mean entropy, repeated (default: a stable row under it stops)."""
    masked = case.logits if case.table is None else mask_logits(case.logits, case.table, case.index)
    draws = CounterDraws()
    ref = sample_step(masked, case.temperature, case.bound, case.keys, draws, case.template)
    z = masked / case.temperature[:, None, None]
    case.prev = ref.argmax.clone()
    changed = torch.arange(len(z)) % 2 == 1 if changed is None else changed
    case.prev[changed, -1] = (case.prev[changed, -1] + 1) % z.shape[-1]
    entropy_mean = ref.entropy.double().nan_to_num().mean(-1)
    case.conf = (entropy_mean * torch.tensor(conf_scale).double().repeat(len(z))[: len(z)]).float()
    out = emulate.run(driver, case, tmp_path, force_scalar)

    stable = update_stability(emulate.stable_in(case), case.prev, ref.argmax)
    assert torch.equal(out["sample"], draws.categorical(case.keys, z))
    for name, want in (
        ("argmax", ref.argmax),
        ("kept", ref.kept),
        ("canvas", ref.canvas),
        ("stable", stable),
    ):
        assert torch.equal(out[name], want), name
    assert torch.equal(out["stop"], should_stop(stable, emulate.stab_k(case), ref.entropy, case.conf))
    log_p = torch.log_softmax(z.double(), -1)
    truth = -(log_p.exp() * log_p).sum(-1)
    if case.template is not None:
        truth = truth.masked_fill(case.template >= 0, 0.0)
    finite = ~ref.entropy.isnan()
    assert torch.equal(out["entropy"].isnan(), ~finite)
    err = (out["entropy"].double() - truth).abs()[finite]
    assert (err <= ENTROPY_RTOL * truth.abs()[finite] + ENTROPY_ATOL).all(), float(err.max())
    max_prob = ref.probs.amax(-1)
    torch.testing.assert_close(out["max_prob"], max_prob, rtol=1e-4, atol=1e-7, equal_nan=True)
    sc = conditioning_softmax(z, torch.bfloat16)
    torch.testing.assert_close(out["probs"].float(), sc, rtol=SC_RTOL, atol=1e-37, equal_nan=True)
    return out


@pytest.mark.parametrize(
    ("dtype", "vocab", "scalar"),
    [(torch.float32, 1000, False), (torch.float32, 1003, True), (torch.bfloat16, 1024, False),
     (torch.bfloat16, 1003, True)],
    ids=["f32x4", "f32x1", "bf16x8", "bf16x1"],
)  # fmt: skip
def test_each_kernel_form_is_the_oracles_step(driver, tmp_path, dtype, vocab, scalar):
    """Vector and scalar loads in both dtypes (a vocabulary that is not a multiple of the vector width takes
    the scalar kernel), pinned template positions, seeds past 2^32 and negative ones."""
    keys = RowKeys(seed=torch.tensor([2**32 + 1, -1]), request=torch.tensor([-5, 2**40]),
                   canvas=torch.tensor([0, 2**33]), step=torch.tensor([0, 7]))  # fmt: skip
    template = torch.full((2, 6), -1, dtype=torch.long)
    template[:, :2] = 5
    case = make_case(2, 6, vocab, dtype, seed=vocab, keys=keys, template=template)
    check(driver, case, tmp_path, force_scalar=scalar)


def test_a_constrained_position_whose_thread_starts_masked_has_finite_probabilities(driver, tmp_path):
    """Only tokens 7 and 3000 allowed out of 4,096: the thread reading 3000 first reads a chunk of masked
    tokens (-1e30 / T), whose self-conditioning sum, measured from the fp32 max, was exp(+2.5e27) = inf;
    the allowed chunk then made it inf * 0 = NaN, and every probability of the position NaN (T = 0.8)."""
    case = make_case(2, 2, 4096, torch.float32, seed=0, temperature=torch.tensor([0.8, 0.75]))
    case.table = torch.zeros(1, 4096, dtype=torch.bool)
    case.table[0, [7, 3000]] = True
    case.index = torch.tensor([[0, -1], [0, -1]])
    out = check(driver, case, tmp_path)
    assert torch.isfinite(out["probs"]).all() and out["probs"][:, 0].float().sum(
        -1
    ).tolist() == pytest.approx([1.0, 1.0], abs=2**-7)


def test_non_finite_logits_give_what_the_oracle_gives(driver, tmp_path):
    """A broken checkpoint's NaN and infinite logits: NaN entropies and probabilities where the oracle has
    them, the first NaN as argmax and sample, a position of nothing but -inf, infinities that win."""
    case = make_case(2, 6, 512, torch.float32, seed=9)
    nan, inf = math.nan, math.inf
    case.logits[0, 1, 123] = nan
    case.logits[0, 2, 5] = case.logits[0, 2, 300] = nan
    case.logits[1, 0] = nan
    case.logits[0, 3, 77] = inf
    case.logits[1, 2, :8] = -inf
    case.logits[1, 3] = -inf
    case.logits[0, 4, 400:] = -inf
    check(driver, case, tmp_path)


def test_the_stop_flag_takes_stability_threshold_and_confidence_into_account(driver, tmp_path):
    """One row per way kernel B's rule can go: stable long enough and confident (stops), the canvas changed
    (count reset), confident but not stable long enough, stable but not confident."""
    case = make_case(4, 3, 64, torch.float32, seed=4)
    case.stable_in, case.stab_k = torch.tensor([2, 5, 1, 2]), torch.tensor([3, 1, 3, 1])
    changed = torch.tensor([False, True, False, False])
    out = check(driver, case, tmp_path, changed=changed, conf_scale=(1.01, 1.01, 1.01, 0.99))
    assert out["stop"].tolist() == [True, False, False, False] and out["stable"].tolist() == [3, 0, 2, 3]
