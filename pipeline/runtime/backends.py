"""What the block-diffusion runtime needs from a model, and the PyTorch implementation of it.

The runtime (scheduling, KV cache, canvases) is the same whatever executes the network; a backend runs
the two kinds of pass:
  * `causal`: prefill / commit — returns the new tokens' K/V, which the runtime writes to its cache;
  * `denoise_step`: one bidirectional pass over the canvas AND its sampling step, because on a GPU the
    sampler is fused into the graph (CUDA kernels here, a TensorRT plugin in an engine) so the
    [B, L, V] logits never leave the device.
`TorchBackend` runs `pipeline.model.network.DiffusionGemma` with the PyTorch sampler (the oracle's
cache-blocked twin, `pipeline.sampler.fused`, for the counter draws) or, on CUDA, the fused kernels; the ONNX Runtime and TensorRT backends implement the same protocol over an exported graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline.model.config import ModelConfig
from pipeline.model.network import DiffusionGemma, grouped_mm_reads_host
from pipeline.sampler.fused import sample_step_fused
from pipeline.sampler.reference import (
    CounterDraws,
    DrawSource,
    RowKeys,
    StepOutput,
    conditioning_rounding,
    conditioning_softmax,
    mask_logits,
    sample_step,
    should_stop,
    update_stability,
)

log = logging.getLogger(__name__)


def uses_fused_sampler(device: torch.device, draws: DrawSource, fused: bool | None = None) -> bool:
    """Whether a runtime on `device` samples with the fused CUDA kernels: on CUDA, with the counter RNG (the
    kernels draw from it alone, so other draw sources, such as tests sharing draws with transformers, take
    the PyTorch sampler), where `fused` asks for them or, left None, where they can run here
    (`cuda_sampler_unavailable`; where they cannot, the reason is logged and the PyTorch sampler runs)."""
    from pipeline.sampler.kernels.gpu_sampler import cuda_sampler_unavailable

    can_fuse = device.type == "cuda" and isinstance(draws, CounterDraws)
    if fused is None and can_fuse:
        unavailable = cuda_sampler_unavailable()
        if unavailable is not None:
            log.warning(f"dgpipe: the fused CUDA sampler is unavailable ({unavailable}): the PyTorch sampler "
                        "takes each step, with fp32 [B, L, V] temporaries and no CUDA graphs")  # fmt: skip
        fused = unavailable is None
    return bool(fused and can_fuse)


KV = list[tuple[torch.Tensor, torch.Tensor]]
Masks = dict[str, torch.Tensor | None]


@dataclass
class SamplerInputs:
    """Per-row sampler state for one denoise step (all [B] or [B, L] tensors on the backend's device)."""

    temperature: torch.Tensor  # [B] fp32
    bound: torch.Tensor  # [B] fp32 entropy bound
    keys: RowKeys  # [B] int64 each: seed, request, canvas, step
    template: torch.Tensor | None  # [B, L] int64 pinned tokens, -1 where free; None when no row pins
    prev_argmax: torch.Tensor  # [B, L] int64 previous argmax canvas (-1 before the first step)
    stable_count: torch.Tensor  # [B] int64
    stability_threshold: torch.Tensor  # [B] int64
    confidence_threshold: torch.Tensor  # [B] fp32 (0: never stop early)
    # constrained decoding: (table [M, V] bool, index [B, L] int64, -1 = free), see reference.mask_logits;
    # None when no row is constrained
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class DenoiseResult:
    # next canvas, argmax canvas, entropy, kept; probs: None where they stay on device, and valid only until
    # the backend's next step (the CPU and CUDA samplers reuse one buffer)
    step: StepOutput
    stable_count: torch.Tensor  # [B] int64
    stop: torch.Tensor  # [B] bool
    # [B, L, hidden] in the backend dtype: softmax(z) @ E * sqrt(d), the next step's self-conditioning
    # input. Computed right after sampling so the runtime keeps hidden, not vocab, values per position
    # (at the 26B's sizes 256 x 2816 bf16 = 1.4 MB per sequence instead of 256 x 262144 = 134 MB).
    # None inside sample_logits before its caller fills it, and when the caller said no step reads it
    soft: torch.Tensor | None = None
    # the logits sampled from, where step.probs are not their softmax(z): the CUDA kernels write the
    # self-conditioning input, softmax(bf16(z)) (`conditioning_softmax`), up to ~0.16 nats from softmax(z)
    # at a 262k vocabulary; log-probabilities and a guide's ranking read `sampled_distribution` instead
    logits: torch.Tensor | None = None


def sampled_distribution(res: DenoiseResult, s: SamplerInputs, rows: torch.Tensor | slice) -> torch.Tensor:
    """softmax(z) at the batch `rows` of a step: the distribution the sampler drew from there, masked as the
    sampler masked it. The step's probs where they are that (the PyTorch steps), else recomputed from its
    logits for these rows only (the CUDA kernels' probs are the self-conditioning input)."""
    if res.logits is None:
        assert res.step.probs is not None
        return res.step.probs[rows]
    z = res.logits[rows].float()
    if s.allowed is not None:
        z = mask_logits(z, s.allowed[0], s.allowed[1][rows])
    return torch.softmax(z / s.temperature[rows][:, None, None], dim=-1)


class ModelBackend(Protocol):
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # K/V cache and self-conditioning dtype

    def causal(self, tokens: torch.Tensor, positions: torch.Tensor, masks: Masks, past: KV | None) -> KV: ...

    def denoise_step(
        self,
        canvas: torch.Tensor,
        sc_soft: torch.Tensor | None,  # [B, L, hidden] previous DenoiseResult.soft; None: no signal
        positions: torch.Tensor,
        masks: Masks,
        past: KV,
        sampler: SamplerInputs,
        need_soft: bool = True,  # False: no later step reads this one's self-conditioning input
    ) -> DenoiseResult: ...


class TorchBackend:
    """The PyTorch model; the sampler is the PyTorch oracle, or the fused CUDA kernels on a GPU."""

    returns_probs = True  # each step's probabilities reach the runtime (log-probabilities can be read)
    # a denoise pass writes its canvas's K/V into the cache's room and attends in place
    # (`network.PastWithRoom`): the scheduler's cache keeps room for a canvas and hands it out
    writes_kv_in_place = True

    def __init__(self, model: DiffusionGemma, draws: DrawSource | None = None, fused: bool | None = None):
        self.model = model
        self.config = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.draws = draws or CounterDraws()
        self.fused = uses_fused_sampler(self.device, self.draws, fused)
        # elsewhere the counter draws take the cache-blocked PyTorch step (bit-identical to the reference)
        self.cpu_fused = not self.fused and type(self.draws) is CounterDraws
        # the CPU sampler's probs, reused step to step: every reader (the soft embedding below, the
        # guided rows' bf16 copy in the scheduler) is done with them before the next step
        self._probs: torch.Tensor | None = None
        # the dtype the sampler's probs are the softmax of z rounded to: the kernels write a bf16 model's
        # self-conditioning input, the PyTorch steps an fp32 one's (`conditioning_probs`)
        self._probs_round = torch.bfloat16 if self.fused else torch.float32

    @property
    def graph_safe(self) -> bool:
        """A denoise step can be captured in a CUDA graph: no host syncs (fused sampler, experts without
        one, whatever the weight format: see `experts_graph_safe`)."""
        return self.fused and experts_graph_safe(self.model)

    def causal(self, tokens: torch.Tensor, positions: torch.Tensor, masks: Masks, past: KV | None) -> KV:
        return self.model.encode_kv(tokens, positions, masks, past)

    def denoise_step(
        self,
        canvas: torch.Tensor,
        sc_soft: torch.Tensor | None,
        positions: torch.Tensor,
        masks: Masks,
        past: KV,
        sampler: SamplerInputs,
        need_soft: bool = True,
    ) -> DenoiseResult:
        """One denoise pass and its sampling step. `need_soft=False` (every row's canvas ends with this
        pass) skips the next step's self-conditioning input, a [B*L, V] x [V, hidden] product as large as
        the LM head's: nothing would read it."""
        logits = self.model.denoise_soft(canvas, sc_soft, positions, masks, past)
        rows, vocab = logits.shape[0] * logits.shape[1], logits.shape[2]
        if self.cpu_fused and (self._probs is None or self._probs.shape != (rows, vocab)):
            self._probs = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        res = sample_logits(
            logits, sampler, self.draws, cuda=self.fused, cpu_fused=self.cpu_fused, probs_out=self._probs
        )
        if need_soft:
            res.soft = self.model.soft_embedding(self.conditioning(logits, sampler, res.step))
        return res

    def conditioning(self, logits: torch.Tensor, sampler: SamplerInputs, step: StepOutput) -> torch.Tensor:
        """The probabilities the next step's self-conditioning input is made of (`conditioning_probs`)."""
        return conditioning_probs(logits, sampler, step, self.dtype, self._probs_round)


def experts_graph_safe(model: DiffusionGemma) -> bool:
    """Every layer's experts run without a host sync on the model's device and dtype. A forward that was
    swapped in on the instance (the fake-quantized experts of an FP8/NVFP4 checkpoint, which read the
    routing counts with `.tolist()`) counts only if it says `graph_safe = True`; modules that replace the
    experts outright (`pipeline.runtime.tensor_cores.ScaledExperts`) say it as a class attribute. The
    grouped bf16 experts are safe only where torch's grouped GEMM has a kernel (`grouped_mm_reads_host`:
    on sm89 or sm120 its fallback copies the offsets to the host); the dense form (fp32 on CUDA) reads
    nothing on the host."""
    p = next(model.parameters())
    probe = torch.empty(0, dtype=p.dtype, device=p.device)
    for layer in model.layers:
        experts = layer.experts
        if "forward" in vars(experts):  # replaced on the instance
            if not getattr(experts.forward, "graph_safe", False):
                return False
        elif hasattr(type(experts), "graph_safe"):
            if not type(experts).graph_safe:
                return False
        elif experts.use_grouped(probe) and grouped_mm_reads_host(probe.device, probe.dtype):
            return False
    return True


def conditioning_probs(
    logits: torch.Tensor, s: SamplerInputs, step: StepOutput, dtype: torch.dtype, probs_round: torch.dtype
) -> torch.Tensor:
    """What the next step's self-conditioning reads: the model's own softmax of z = logits / T, with z rounded
    to the model's `dtype` as transformers rounds it (`conditioning_softmax`), unmasked even under a
    constraint. The step's probs serve where they are that softmax: unmasked and rounded as this model's
    (`probs_round`, the sampler's rounding); else it is computed here. The graph backends compute it inside the
    graph, before any mask (their sampler has no mask input), so every backend feeds the same signal; the
    constraint acts on sampling and acceptance."""
    if s.allowed is None and step.probs is not None and conditioning_rounding(dtype) == probs_round:
        return step.probs
    return conditioning_softmax(logits / s.temperature[:, None, None], dtype)


def sample_logits(
    logits: torch.Tensor,
    s: SamplerInputs,
    draws: DrawSource | None = None,
    cuda: bool = False,
    cpu_fused: bool = True,
    probs_out: torch.Tensor | None = None,
) -> DenoiseResult:
    """The sampling half of a denoise step, with the constraint masks applied first (before sampling and
    before the entropy rule). `cuda`: the fused CUDA kernels; else the cache-blocked PyTorch step for the
    counter draws (`cpu_fused`; `probs_out`: its reusable probs buffer) or the reference. Backends whose sampler is fused into their graph (ONNX
    Runtime, TensorRT) call it for constrained batches on the graph's `logits` output."""
    draws = draws or CounterDraws()
    if cuda:  # the kernels read the compact masks themselves: no masked copy of the logits
        from pipeline.sampler.kernels.gpu_sampler import sample_step_cuda

        out, stable, stop = sample_step_cuda(
            logits,
            s.temperature,
            s.bound,
            s.keys,
            s.template,
            s.prev_argmax,
            s.stable_count,
            s.stability_threshold,
            s.confidence_threshold,
            allowed=s.allowed,
        )
        return DenoiseResult(out, stable, stop, logits=logits)
    if s.allowed is not None:
        logits = mask_logits(logits, *s.allowed)
    if cpu_fused and type(draws) is CounterDraws and logits.dtype == torch.float32:
        out = sample_step_fused(logits, s.temperature, s.bound, s.keys, s.template, probs_out=probs_out)
    else:
        out = sample_step(logits, s.temperature, s.bound, s.keys, draws, s.template)
    stable = update_stability(s.stable_count, s.prev_argmax, out.argmax)
    stop = should_stop(stable, s.stability_threshold, out.entropy, s.confidence_threshold)
    return DenoiseResult(out, stable, stop)
