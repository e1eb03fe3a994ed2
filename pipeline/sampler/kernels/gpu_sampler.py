"""The sampler step on the GPU: two fused kernels (csrc/dg_sampler.cu) instead of the PyTorch sampler.

Same meaning as `pipeline.sampler.reference.sample_step` followed by `update_stability` and `should_stop`, with
`CounterDraws` as the draw source, but with no fp32 [B, L, V] temporaries: the PyTorch step makes several
(z, log-probs, Gumbel noise, probs), which is what exhausted memory under concurrency elsewhere
(docs/model.md, "Self-conditioning"). The only full-size output is the bf16 self-conditioning input.

The denoise loop (`pipeline.runtime.scheduler`, `_denoise`) can swap its three calls for one:

    out, stable, stop = sample_step_cuda(logits, temp, bound, keys, template, amax, stable, stab_k, conf)

Importing this module needs no CUDA; the first call builds the extension (`build.load_torch_extension`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pipeline.errors import SamplerError, error_line
from pipeline.sampler.reference import RowKeys, StepOutput

MAX_CANVAS = 1024  # kernel B sorts one row in one thread block


@dataclass
class StepBuffers:
    """Outputs of one step, reusable across steps (and poisonable by tests)."""

    entropy: torch.Tensor  # [B, L] fp32, 0 at pinned positions
    max_prob: torch.Tensor  # [B, L] fp32, max_v softmax(z)
    argmax: torch.Tensor  # [B, L] int64 argmax canvas (template at pinned positions)
    sample: torch.Tensor  # [B, L] int64 Gumbel-max sample of every position (before acceptance)
    probs: torch.Tensor  # [B, L, V] bf16 softmax(z): next step's self-conditioning input
    canvas: torch.Tensor  # [B, L] int64 next input canvas
    kept: torch.Tensor  # [B, L] bool
    stable: torch.Tensor  # [B] int64 updated stability counter
    stop: torch.Tensor  # [B] bool

    @classmethod
    def allocate(cls, batch: int, length: int, vocab: int, device: torch.device | str) -> StepBuffers:
        def tok() -> torch.Tensor:
            return torch.empty(batch, length, dtype=torch.int64, device=device)

        return cls(
            entropy=torch.empty(batch, length, dtype=torch.float32, device=device),
            max_prob=torch.empty(batch, length, dtype=torch.float32, device=device),
            argmax=tok(),
            sample=tok(),
            probs=torch.empty(batch, length, vocab, dtype=torch.bfloat16, device=device),
            canvas=tok(),
            kept=torch.empty(batch, length, dtype=torch.bool, device=device),
            stable=torch.empty(batch, dtype=torch.int64, device=device),
            stop=torch.empty(batch, dtype=torch.bool, device=device),
        )


@functools.cache
def cuda_sampler_unavailable() -> str | None:
    """Why the kernels cannot run in this process, or None: they need a CUDA build of torch with a visible
    GPU and their extension built (the first time with nvcc and ninja; torch caches the build). Built here,
    once, so that a missing tool or a failed build sends the runtime to the PyTorch sampler when it is set
    up, not to an error on its first step."""
    from pipeline.sampler.kernels.build import load_torch_extension

    if torch.version.cuda is None or not torch.cuda.is_available():
        return f"no CUDA GPU visible (torch {torch.__version__})"
    try:
        load_torch_extension()
    except Exception as e:  # a missing tool (DgpipeError) or the build's own failure
        return error_line(e)
    return None


def cuda_sampler_available() -> bool:
    """True where the kernels can run (`cuda_sampler_unavailable`)."""
    return cuda_sampler_unavailable() is None


def _row(
    value: torch.Tensor | float | int, batch: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).to(dtype)
    return (t.expand(batch) if t.dim() == 0 else t).contiguous()


def sample_step_cuda(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    bound: torch.Tensor,
    keys: RowKeys,
    template: torch.Tensor | None,
    prev_argmax: torch.Tensor,
    stable_count: torch.Tensor,
    stability_threshold: torch.Tensor | int,
    confidence_threshold: torch.Tensor | float,
    *,
    out: StepBuffers | None = None,
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[StepOutput, torch.Tensor, torch.Tensor]:
    """One denoise step's sampling for B rows on the GPU; returns (step output, stable count, stop).

    `logits` [B, L, V] fp32 or bf16 (already softcapped), `template` [B, L] (-1 where free) or None,
    `prev_argmax` [B, L] (the previous argmax canvas, -1 before the first step), `stable_count` [B].
    The step output's `probs` is bf16 (the PyTorch sampler's is fp32; the runtime stores it in the
    model dtype either way). `allowed`: constrained decoding's compact masks (table [M, V] bool, index
    [B, L] int64, -1 = free), applied inside kernel A exactly as `reference.mask_logits` does."""
    from pipeline.sampler.kernels.build import load_torch_extension

    if logits.dim() != 3 or not logits.is_cuda:
        raise SamplerError(
            f"logits must be a [B, L, V] CUDA tensor, got {tuple(logits.shape)} on {logits.device}"
        )
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise SamplerError(f"logits must be float32 or bfloat16, got {logits.dtype}")
    batch, length, vocab = logits.shape
    if not 1 <= length <= MAX_CANVAS:
        raise SamplerError(f"canvas length must be in [1, {MAX_CANVAS}], got {length}")
    ext = load_torch_extension()
    dev = logits.device
    i64 = lambda t: _row(t, batch, torch.int64, dev)
    f32 = lambda t: _row(t, batch, torch.float32, dev)
    seed, request, canvas, step = i64(keys.seed), i64(keys.request), i64(keys.canvas), i64(keys.step)
    buf = out if out is not None else StepBuffers.allocate(batch, length, vocab, dev)
    tpl = None if template is None else template.to(dev, torch.int64).contiguous()
    prev = prev_argmax.to(dev, torch.int64).contiguous()
    if prev.data_ptr() == buf.argmax.data_ptr():  # reused buffers: kernel A overwrites argmax first
        prev = prev.clone()
    ext.rows(
        logits.contiguous(),
        f32(temperature),
        seed,
        request,
        canvas,
        step,
        buf.entropy,
        buf.max_prob,
        buf.argmax,
        buf.sample,
        buf.probs,
        None if allowed is None else allowed[0].to(dev, torch.bool).contiguous(),
        None if allowed is None else allowed[1].to(dev, torch.int64).contiguous(),
    )
    ext.accept(
        vocab,
        buf.entropy,
        buf.argmax,
        buf.sample,
        tpl,
        f32(bound),
        seed,
        request,
        canvas,
        step,
        prev,
        i64(stable_count),
        i64(stability_threshold),
        f32(confidence_threshold),
        buf.entropy,
        buf.kept,
        buf.canvas,
        buf.argmax,
        buf.stable,
        buf.stop,
    )
    step_out = StepOutput(
        canvas=buf.canvas, argmax=buf.argmax, probs=buf.probs, entropy=buf.entropy, kept=buf.kept
    )
    return step_out, buf.stable, buf.stop
