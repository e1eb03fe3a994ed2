"""Memory planner: exported bytes per precision and serving memory per GPU, from config.json alone.

The model is instantiated on the meta device (no weights, no memory), so the 26B-A4B plan is exact for
the real architecture and takes milliseconds.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass

import torch

from pipeline.model.config import ModelConfig
from pipeline.model.network import DiffusionGemma
from pipeline.targets import Precision, Target

GIB = 2**30


@dataclass
class WeightPlan:
    precision: str
    quantized_params: int
    high_precision_params: int
    bytes: int

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class ServingPlan:
    target: str
    gpu: str
    precision: str
    weights_gib: float
    kv_cache_gib: float
    workspace_gib: float
    total_gib: float
    gpu_memory_gib: float
    fits: bool
    context: int
    concurrency: int


def _is_quantized(name: str, p: Precision) -> bool:
    if any(fnmatch.fnmatch(name, pat) for pat in p.keep_high_precision):
        return False
    return any(fnmatch.fnmatch(name, pat) for pat in p.quantize)


def weight_plan(config: ModelConfig, p: Precision) -> WeightPlan:
    with torch.device("meta"):
        model = DiffusionGemma(config)
    quantized = high = 0
    for name, param in model.named_parameters():
        if param.dim() >= 2 and _is_quantized(name, p):
            quantized += param.numel()
        else:
            high += param.numel()
    total = int(quantized * p.weight_bytes_per_param()) + high * 2  # high-precision tensors stay bf16
    return WeightPlan(p.name, quantized, high, total)


def kv_cache_bytes(config: ModelConfig, context: int, concurrency: int, bytes_per_value: int = 2) -> int:
    """Sliding layers keep window - 1 tokens (ring buffer); global layers keep the whole context."""
    t = config.text_config
    total = 0
    for i in range(t.num_hidden_layers):
        s = t.layer_shape(i)
        tokens = min(context, t.sliding_window - 1) if s.is_sliding else context
        total += 2 * s.num_kv_heads * s.head_dim * tokens * bytes_per_value
    return total * concurrency


def workspace_bytes(config: ModelConfig, concurrency: int) -> int:
    """Per denoise pass: the bf16 self-conditioning probabilities [C, canvas, vocab] (the fused sampler
    never materialises fp32 logits), bf16 logits, and activations of one canvas batch."""
    t = config.text_config
    canvas = config.canvas_length
    sc_probs = concurrency * canvas * t.vocab_size * 2
    logits = concurrency * canvas * t.vocab_size * 2
    activations = concurrency * canvas * max(t.hidden_size * 8, t.num_experts * t.moe_intermediate_size) * 2
    return sc_probs + logits + activations


def serving_plan(
    config: ModelConfig, p: Precision, target: Target, context: int, concurrency: int, kv_cache: str = "none"
) -> list[ServingPlan]:
    """`kv_cache="fp8"` stores K/V in one byte per value (ModelOpt's KV-cache quantization)."""
    w = weight_plan(config, p)
    kv = kv_cache_bytes(config, context, concurrency, 1 if kv_cache == "fp8" else 2)
    ws = workspace_bytes(config, concurrency)
    plans = []
    for gpu in target.gpus:
        total = w.bytes + kv + ws
        plans.append(
            ServingPlan(
                target=target.name,
                gpu=gpu.product,
                precision=p.name,
                weights_gib=round(w.gib, 2),
                kv_cache_gib=round(kv / GIB, 2),
                workspace_gib=round(ws / GIB, 2),
                total_gib=round(total / GIB, 2),
                gpu_memory_gib=gpu.memory_gib,
                fits=total <= 0.9 * gpu.memory_gib * GIB,  # leave 10% for CUDA context and fragmentation
                context=context,
                concurrency=concurrency,
            )
        )
    return plans


def as_dict(obj) -> dict:
    return asdict(obj)
