"""The entropy-bound sampler step in plain PyTorch: the oracle the CUDA kernels are tested against.

One call turns a denoise pass's logits into the next canvas (docs/model.md, "Sampler"):
  z = logits / T;  p = softmax(z);  cand ~ p (Gumbel-max);  amax = argmax z;  H = entropy(p)
  keep the lowest-entropy positions while  cumsum(H_sorted) - H_sorted <= bound  (the lowest is always kept)
  everything not kept is re-noised with uniform tokens; infill positions are pinned to their template token.
Randomness comes from a `DrawSource` so tests can share draws with transformers' sampler and production
uses stateless counter-based draws (`pipeline.sampler.rng`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.sampler import rng


@dataclass
class RowKeys:
    """Coordinates of each row's draws: which request, which canvas of it, which denoise step."""

    seed: torch.Tensor
    request: torch.Tensor
    canvas: torch.Tensor
    step: torch.Tensor


class DrawSource(Protocol):
    def initial_canvas(self, keys: RowKeys, length: int, vocab: int) -> torch.Tensor: ...
    def categorical(self, keys: RowKeys, z: torch.Tensor) -> torch.Tensor: ...
    def renoise(self, keys: RowKeys, length: int, vocab: int) -> torch.Tensor: ...


class CounterDraws:
    """Production draws: a pure function of (seed, request, canvas, step, position[, token])."""

    def initial_canvas(self, keys: RowKeys, length: int, vocab: int) -> torch.Tensor:
        k = rng.key_hash(keys.seed, keys.request, keys.canvas, keys.step, rng.STREAM_INIT)
        return rng.uniform_tokens(k, length, vocab)

    def categorical(self, keys: RowKeys, z: torch.Tensor) -> torch.Tensor:
        k = rng.key_hash(keys.seed, keys.request, keys.canvas, keys.step, rng.STREAM_SAMPLE)
        return torch.argmax(z + rng.gumbel(k, z.shape[1], z.shape[2]).to(z.device), dim=-1)

    def renoise(self, keys: RowKeys, length: int, vocab: int) -> torch.Tensor:
        k = rng.key_hash(keys.seed, keys.request, keys.canvas, keys.step, rng.STREAM_RENOISE)
        return rng.uniform_tokens(k, length, vocab)


def masked_logit(dtype: torch.dtype) -> float:
    """What a disallowed token's logit becomes: −inf in effect (exp underflows to exactly 0, and the Gumbel
    argmax never picks it) but finite, so the entropy's 0·log 0 stays 0 instead of NaN. A quarter of the
    dtype's range leaves room for the division by a temperature below 1."""
    return -min(1e30, torch.finfo(dtype).max / 4)


def mask_logits(logits: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Constrained decoding's per-position masks, applied before sampling and before the entropy rule.

    Compact form (the [B, L, V] mask of a 262k vocabulary would be 67 MB per row): `table` [M, V] bool holds
    the distinct allowed sets of this step, `index` [B, L] int64 names each position's row of it, -1 where
    the position is free."""
    allowed = table[index.clamp(min=0)] | (index < 0)[..., None]
    return logits.masked_fill(~allowed, masked_logit(logits.dtype))


@dataclass
class StepOutput:
    canvas: torch.Tensor  # [B, L] next input canvas (kept samples + fresh noise + pinned template)
    argmax: torch.Tensor  # [B, L] argmax canvas: the draft, and what gets committed
    probs: torch.Tensor | None  # [B, L, V] softmax(z) (fp32 here); None from a graph that keeps it on device
    entropy: torch.Tensor  # [B, L] per-position entropy (0 at pinned positions)
    kept: torch.Tensor  # [B, L] bool


def conditioning_rounding(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scaled logits are rounded to before the self-conditioning softmax, for a model in `dtype`:
    its own where narrower than fp32 (transformers keeps them in the embedding dtype), else fp32 (no rounding)."""
    return dtype if dtype.itemsize < 4 else torch.float32


def conditioning_softmax(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The next step's self-conditioning probabilities from this step's scaled logits `z`, as transformers
    computes them for a model in `dtype`: it keeps the scaled logits in the embedding dtype between steps
    (`processed_logits.to(embeddings_dtype)`) and its decoder softmaxes them in fp32. In bf16 that rounding moves
    a logit by up to 2^-9 of its size (0.125 at 32), so the probabilities differ by percents from the softmax of
    the fp32 logits; in fp32 and float64 it is the plain softmax."""
    rounding = conditioning_rounding(dtype)
    if rounding != torch.float32:
        z = z.to(rounding)
    return torch.softmax(z, dim=-1, dtype=torch.float32)


def temperatures(
    step: torch.Tensor, n_steps: torch.Tensor, t_min: torch.Tensor, t_span: torch.Tensor
) -> torch.Tensor:
    """Linear schedule per row: t_max at step 0 down to t_min + (t_max - t_min)/N at step N-1, rounded as
    transformers rounds it (`t_span` = t_max - t_min taken in double, then stored; the steps left over N
    first, in t_min's dtype), so that the logits are divided by the very same temperature."""
    left = (n_steps - step).to(t_min.dtype) / n_steps.to(t_min.dtype)
    return t_min + t_span * left


def entropy_bound_keep(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """EB-sampler acceptance (arXiv 2505.24857): keep the k lowest-entropy positions with
    sum(H_1..k) - max(H_1..k) <= bound. Sorted ascending, the max of a prefix is its last element."""
    # stable: ties (e.g. pinned positions, all 0) keep index order on every device, as the kernel does
    sorted_h, order = torch.sort(entropy, dim=-1, descending=False, stable=True)
    keep_sorted = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound[:, None]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_step(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    bound: torch.Tensor,
    keys: RowKeys,
    draws: DrawSource,
    template: torch.Tensor | None = None,
) -> StepOutput:
    """One denoise step's sampling for B rows. `template` [B, L] holds pinned tokens, -1 where free."""
    z = logits / temperature[:, None, None]
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    cand = draws.categorical(keys, z)
    amax = torch.argmax(z, dim=-1)
    probs = torch.softmax(z, dim=-1, dtype=torch.float32)  # an fp32 model's self-conditioning input
    return accept(cand, amax, probs, entropy, bound, keys, draws, template)


def accept(
    cand: torch.Tensor,
    amax: torch.Tensor,
    probs: torch.Tensor,
    entropy: torch.Tensor,
    bound: torch.Tensor,
    keys: RowKeys,
    draws: DrawSource,
    template: torch.Tensor | None,
) -> StepOutput:
    """The [B, L] half of a step: pin the template, keep by entropy bound, re-noise the rest."""
    if template is not None:
        pinned = template >= 0
        entropy = entropy.masked_fill(pinned, 0.0)  # pinned cells cost nothing from the budget
    kept = entropy_bound_keep(entropy, bound)
    noise = draws.renoise(keys, probs.shape[1], probs.shape[2]).to(cand.device)
    canvas = torch.where(kept, cand, noise)
    if template is not None:
        canvas = torch.where(pinned, template, canvas)
        amax = torch.where(pinned, template, amax)
    return StepOutput(canvas=canvas, argmax=amax, probs=probs, entropy=entropy, kept=kept)


def update_stability(count: torch.Tensor, prev_argmax: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Consecutive steps whose argmax canvas equalled the previous one (reset on any change)."""
    same = (argmax == prev_argmax).all(dim=-1)
    return torch.where(same, count + 1, torch.zeros_like(count))


def should_stop(
    stable_count: torch.Tensor,
    stability_threshold: torch.Tensor,
    entropy: torch.Tensor,
    confidence_threshold: torch.Tensor,
) -> torch.Tensor:
    """Stable-and-confident adaptive stop: the argmax canvas held for `stability_threshold` steps and the
    mean entropy is below `confidence_threshold` (0 never triggers: fixed steps)."""
    return (stable_count >= stability_threshold) & (entropy.mean(dim=-1) < confidence_threshold)
