"""MatMul FLOPs of one denoise pass, counted from the config: one source for the exported graph's cross-check
(`pipeline.onnx.flops`), the export contract and `dgpipe bench pass`'s hardware floor.

Counted: every GEMM a denoise pass with a self-conditioning signal runs, 2 FLOPs per multiply-add: the
self-conditioning MLP, per layer the q/k/(v)/o projections, attention (QK^T and PV over cached + canvas
keys; sliding layers see at most `sliding_window - 1` cached tokens), the dense MLP, the router and the
experts (top-k routed, or all of them for the dense export), the tied LM head, and the soft embedding
of the sampled probabilities (probs @ E) the next pass reads. Norms, softmaxes and the sampler are not
matmuls and are left out. Light on purpose: config only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.model.config import TextConfig


@dataclass(frozen=True)
class PassFlops:
    """One pass's matmul FLOPs by the weights they multiply: what a quantized checkpoint quantizes (the
    linears and the experts) runs at its format's tensor-core rate, the rest in bf16 in every format."""

    linears: int  # q/k/(v)/o projections and the dense MLP
    experts: int  # the routed experts (all of them for the dense export)
    other: int  # attention's QK^T and PV, router, self-conditioning MLP, LM head, soft embedding

    @property
    def total(self) -> int:
        return self.linears + self.experts + self.other


def denoise_pass_flop_parts(
    cfg: TextConfig, batch: int, seq: int, past: int, routed: bool = True, step: bool = True
) -> PassFlops:
    """`denoise_pass_flops` split by `PassFlops`' parts. `step=False`: the network's pass alone, without
    the soft embedding of its probabilities for the next step (what `dgpipe bench gpu` times)."""
    d, hidden, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    ring = min(past, max(cfg.sliding_window - 1, 1))
    linears = experts = other = 0
    for i in range(cfg.num_hidden_layers):
        s = cfg.layer_shape(i)
        q, kv = heads * s.head_dim, s.num_kv_heads * s.head_dim
        keys = (ring if s.is_sliding else past) + seq
        linears += 2 * d * (q + kv * (2 if s.is_sliding else 1)) + 2 * q * d  # q, k, (v), o projections
        linears += 2 * 3 * d * hidden  # dense MLP
        other += 2 * 2 * q * keys + 2 * d * cfg.num_experts  # QK^T and PV, router
        experts += 2 * 3 * d * cfg.moe_intermediate_size * (cfg.top_k_experts if routed else cfg.num_experts)
    self_conditioning = 2 * 3 * d * hidden + (2 * cfg.vocab_size * d if step else 0)  # MLP; probs @ E next
    head = 2 * d * cfg.vocab_size
    tokens = batch * seq
    return PassFlops(tokens * linears, tokens * experts, tokens * (other + self_conditioning + head))


def denoise_pass_flops(cfg: TextConfig, batch: int, seq: int, past: int, routed: bool = True) -> int:
    """FLOPs of one pass over `batch` canvases of `seq` tokens with `past` cached tokens."""
    return denoise_pass_flop_parts(cfg, batch, seq, past, routed).total
