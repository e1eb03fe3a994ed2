"""Memory planner: exported bytes per precision and serving memory per GPU, from config.json alone.

The model is instantiated on the meta device (no weights, no memory), so the 26B-A4B plan is exact for
the real architecture and takes milliseconds.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass

import torch

from pipeline.limits import DEFAULTS
from pipeline.model.config import ModelConfig
from pipeline.model.network import DiffusionGemma
from pipeline.runtime.backends import TorchBackend
from pipeline.runtime.dispatch import dispatch, weight_bytes
from pipeline.runtime.kv_cache import KVCache, canvas_room
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
    prefix_cache_gib: float
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


def held_weight_bytes(config: ModelConfig, p: Precision, target: Target) -> int:
    """What the PyTorch runtime holds in GPU memory on `target` for a checkpoint in `p`, which is not always
    what the checkpoint stores (`weight_plan`): the linears and experts in the formats the target's dispatch
    row reads them in (`pipeline.runtime.dispatch.weight_bytes`: an NVFP4 checkpoint's experts as FP8 on RTX
    Blackwell, whose torch has no grouped GEMM; INT4-AWQ dequantized to bf16, for which torch has no W4A16
    grouped GEMM), every other weight in bf16."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    every = sum(t.numel() for t in model.parameters())
    held = weight_bytes(config.text_config, dispatch(p.name, target.name))
    as_bf16 = weight_bytes(config.text_config, dispatch("bf16", target.name))  # 2 bytes per parameter
    rest = every - (as_bf16["linears"] + as_bf16["experts"]) / 2
    return int(held["linears"] + held["experts"] + 2 * rest)


def kv_cache_bytes(config: ModelConfig, context: int, concurrency: int, bytes_per_value: int = 2) -> int:
    """The K/V cache the PyTorch runtime allocates for `concurrency` rows of `context` tokens, made on the
    meta device so that plan and runtime cannot disagree (`KVCache`): global layers the whole context,
    sliding layers a ring of window - 1 tokens whatever the context, and past it room for a canvas's K/V,
    which the denoise pass writes there (`kv_cache.canvas_room`)."""
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[bytes_per_value]
    room = canvas_room(TorchBackend, config.canvas_length)
    return KVCache(config.text_config, concurrency, context, dtype, "meta", room).nbytes()


@dataclass
class Workspace:
    """Bytes a denoise pass of `concurrency` canvases holds at its peak on the GPU serving path (PyTorch
    runtime with the fused sampler), as the runtime allocates them:
      * `sc_state`: the scheduler's self-conditioning store, the previous step's soft embedding
        softmax(z) @ E * sqrt(d) [C, canvas, hidden] in the model dtype (bf16), kept between steps
        (`BlockDiffusionRuntime.sc`; `sc_state_bytes_per_sequence`);
      * `sc_input`: the copy of it gathered and masked for the pass (`_device_step`), alive through it;
      * `logits`: the softcapped logits, fp32 on every path (`DiffusionGemma.logits`);
      * `softcap_temporaries`: 0: without autograd the softcap runs in place on the logits
        (`DiffusionGemma.logits`; with autograd, in training, it holds two more fp32 copies);
      * `sampler_probs`: the fused sampler's bf16 probabilities, allocated once the softcap temporaries
        are gone, so it does not add to the peak; they live only until the soft embedding of the next
        step is taken from them right after sampling (`DenoiseResult.soft`, [C, canvas, hidden]);
      * `activations`: one canvas batch's hidden states and the widest MoE intermediate, bf16;
      * `graph_pool`: under CUDA graphs (`pipeline.runtime.device_loop`) the captured step's own copy of
        everything above but the store: its allocations stay in the graphs' private pool, while each round's
        eager warm-up step allocates the same again outside it.
    The peak is at the sampler: sc_state + sc_input + fp32 logits + bf16 probs + activations (the fresh soft
    embedding, [C, canvas, hidden], is the size of sc_state), plus the graph pool."""

    sc_state: int
    sc_input: int
    logits: int
    softcap_temporaries: int
    sampler_probs: int
    activations: int
    graph_pool: int = 0

    @property
    def step(self) -> int:
        """One step's own allocations at its peak (all but the store kept between steps)."""
        at_softcap = self.logits + self.softcap_temporaries
        at_sampler = self.logits + self.sampler_probs
        return self.sc_input + max(at_softcap, at_sampler) + self.activations

    @property
    def peak(self) -> int:
        return self.sc_state + self.step + self.graph_pool


def sc_state_bytes_per_sequence(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """Self-conditioning state one sequence keeps between denoise steps: [canvas, hidden] in the model dtype
    (26B-A4B, bf16: 256 x 2816 x 2 = 1.44 MB; [canvas, vocab] probabilities would be 134 MB in bf16)."""
    return config.canvas_length * config.text_config.hidden_size * dtype_bytes


def workspace(config: ModelConfig, concurrency: int, dtype_bytes: int = 2, graphs: bool = True) -> Workspace:
    """`graphs`: the step runs under CUDA graphs (the GPU serving path), which hold a second copy of it."""
    t = config.text_config
    cells = concurrency * config.canvas_length * t.vocab_size  # one [C, canvas, vocab] tensor
    widest = max(t.hidden_size * 8, t.num_experts * t.moe_intermediate_size)
    sc = concurrency * sc_state_bytes_per_sequence(config, dtype_bytes)
    ws = Workspace(
        sc_state=sc,
        sc_input=sc,
        logits=cells * 4,
        softcap_temporaries=0,
        sampler_probs=cells * 2,
        activations=concurrency * config.canvas_length * widest * dtype_bytes,
    )
    ws.graph_pool = ws.step if graphs else 0
    return ws


def workspace_bytes(config: ModelConfig, concurrency: int, graphs: bool = True) -> int:
    """Peak denoise-pass workspace (see `Workspace`)."""
    return workspace(config, concurrency, graphs=graphs).peak


def serving_plan(
    config: ModelConfig,
    p: Precision,
    target: Target,
    context: int,
    concurrency: int,
    kv_cache: str = "none",
    prefix_cache_mib: int = DEFAULTS.prefix_cache_mib,
) -> list[ServingPlan]:
    """`kv_cache="fp8"` stores K/V in one byte per value (ModelOpt's KV-cache quantization);
    `prefix_cache_mib`: the K/V of prompt blocks the server keeps across requests (its limit of that name).
    The weights are what the runtime holds on the target (`held_weight_bytes`)."""
    weights = held_weight_bytes(config, p, target)
    kv = kv_cache_bytes(config, context, concurrency, 1 if kv_cache == "fp8" else 2)
    ws = workspace_bytes(config, concurrency)
    prefix = prefix_cache_mib << 20
    plans = []
    for gpu in target.gpus:
        total = weights + kv + ws + prefix
        plans.append(
            ServingPlan(
                target=target.name,
                gpu=gpu.product,
                precision=p.name,
                weights_gib=round(weights / GIB, 2),
                kv_cache_gib=round(kv / GIB, 2),
                workspace_gib=round(ws / GIB, 2),
                prefix_cache_gib=round(prefix / GIB, 2),
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
