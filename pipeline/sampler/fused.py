"""The CPU sampler step with one cache-resident sweep over [B, L, V]: same draws as the reference, faster.

`reference.sample_step` is written for reading: every stage (z, log-softmax, entropy, Gumbel noise,
z + g, softmax) is a separate [B, L, V] tensor, about 30 full passes through memory per step. Here the
rows (positions) are processed in blocks small enough to stay in cache, with preallocated scratch and
in-place ops, and the Gumbel noise is never materialised. Every fp32 value is produced by the same
operation on the same inputs as in the reference (per-row reductions over the same contiguous rows,
`z - log(-log u)` being `z + g` exactly), so tokens, entropies, kept sets and probabilities are
bit-identical; `tests/unit/sampler/test_fused.py` checks that against the reference.
"""

from __future__ import annotations

import torch

from pipeline.sampler import rng
from pipeline.sampler.reference import CounterDraws, RowKeys, StepOutput, accept

BLOCK_ELEMENTS = 1 << 18  # fp32 elements per scratch buffer: 1 MiB, so a block's working set fits in L2


def first_argmax_(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, countdown: torch.Tensor) -> None:
    """`torch.argmax(x, -1, out=out)` for fp32 rows [R, V], the same index (the first maximum), ~3x faster.

    torch's CPU argmax walks each row with a scalar (value, index) loop; here every pass is a vectorised
    fp32 kernel: the row max, x == max as 1.0/0.0, times the countdown V, V-1, ..., 1 (exact in fp32:
    V <= 2**21 by CONFIG_LIMITS), and a row max again, which is V - (the first index of the maximum). A row
    with a NaN (whose max is NaN and equal to nothing) keeps argmax's own answer, the first NaN."""
    peak = x.amax(-1, keepdim=True)
    torch.eq(x, peak, out=scratch)
    scratch.mul_(countdown)
    out.copy_(scratch.amax(-1)).neg_().add_(x.shape[-1])
    nan_rows = peak.isnan().view(-1)
    if nan_rows.any():
        out[nan_rows] = torch.argmax(x[nan_rows], dim=-1)


def sample_step_fused(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    bound: torch.Tensor,
    keys: RowKeys,
    template: torch.Tensor | None = None,
    block_elements: int = BLOCK_ELEMENTS,
    probs_out: torch.Tensor | None = None,
) -> StepOutput:
    """`reference.sample_step(logits, temperature, bound, keys, CounterDraws(), template)`, bit for bit,
    for fp32 logits (the network's softcapped output).

    `probs_out`: a [B*L, V] fp32 buffer for the returned probabilities, reused across steps by a caller
    that reads them before the next step (as the CUDA sampler's buffers are). A fresh [B*L, V] tensor is
    tens of MB at a real vocabulary: mmap'd and page-faulted on first touch every step."""
    b, length, vocab = logits.shape
    n = b * length
    dev = logits.device
    flat = logits.reshape(n, vocab)
    t_rows = temperature.to(logits.dtype).repeat_interleave(length)[:, None]  # [N, 1]
    sample_key = rng.key_hash(keys.seed, keys.request, keys.canvas, keys.step, rng.STREAM_SAMPLE)
    pos_key = rng.position_bits_i32(sample_key, length).reshape(n)  # [N] int32
    vocab_ids = torch.arange(vocab, dtype=torch.int32, device=dev)
    countdown = torch.arange(vocab, 0, -1, dtype=torch.float32, device=dev)

    fits = probs_out is not None and probs_out.shape == (n, vocab) and probs_out.dtype == torch.float32
    probs = probs_out if fits else torch.empty(n, vocab, dtype=torch.float32, device=dev)
    neg_entropy = torch.empty(n, dtype=torch.float32, device=dev)
    cand = torch.empty(n, dtype=torch.long, device=dev)
    amax = torch.empty(n, dtype=torch.long, device=dev)
    # At least 2 rows per block: torch splits a reduction with a single output across threads (a different
    # summation order from the reference's per-row sums); with 2+ outputs it parallelises over rows.
    rows = max(min(n, 2), min(n, block_elements // vocab))
    starts = list(range(0, n, rows))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()  # no 1-row tail: the last block takes it
    z_buf = torch.empty(rows + 1, vocab, dtype=torch.float32, device=dev)
    logp_buf = torch.empty_like(z_buf)
    work_buf = torch.empty_like(z_buf)
    bits_buf = torch.empty(rows + 1, vocab, dtype=torch.int32, device=dev)
    for i, r0 in enumerate(starts):
        r1 = starts[i + 1] if i + 1 < len(starts) else n
        k = r1 - r0
        z, logp, work = z_buf[:k], logp_buf[:k], work_buf[:k]
        torch.div(flat[r0:r1], t_rows[r0:r1], out=z)
        first_argmax_(z, amax[r0:r1], work, countdown)
        torch._softmax(z, -1, False, out=probs[r0:r1])
        # entropy: -(exp(logp) * logp).sum(-1)
        torch._log_softmax(z, -1, False, out=logp)
        torch.exp(logp, out=work)
        work.mul_(logp)
        torch.sum(work, dim=-1, out=neg_entropy[r0:r1])
        # Gumbel-max: argmax(z + g) with g = -log(-log u), i.e. argmax(z - log(-log u))
        rng.gumbel_rows_(pos_key[r0:r1], vocab_ids, work, bits_buf[:k])
        torch.sub(z, work, out=work)
        first_argmax_(work, cand[r0:r1], logp, countdown)
    entropy = neg_entropy.neg_().reshape(b, length)
    shape = (b, length)
    return accept(
        cand.reshape(shape),
        amax.reshape(shape),
        probs.reshape(b, length, vocab),
        entropy,
        bound,
        keys,
        CounterDraws(),
        template,
    )
