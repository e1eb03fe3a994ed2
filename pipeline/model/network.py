"""DiffusionGemma's text backbone, shaped for inference and training with the same code.

One set of weights runs in two modes (docs/model.md, "Encoder and decoder modes"):
  * encoder (prefill, commit, causal LM): causal attention, returns the new K/V so a cache can keep them;
  * decoder (denoise): the canvas attends bidirectionally to itself and to the cached context, with the
    self-conditioning signal mixed into its input; it never writes K/V.

Attention takes the context K/V explicitly (`past`) instead of owning a cache, so training can feed the
encoder's K/V straight into the decoder with gradients, and the serving runtime can keep a pre-allocated
ring-buffer cache (`pipeline.runtime.kv_cache`). Module and parameter names match transformers'
`model.decoder.*` so checkpoints map one-to-one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.config import ModelConfig, TextConfig
from pipeline.model.scaled_layout import ExpertOrder, OrderKernel, QuantizedRows, expert_order, slot_rows


def _tracing() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()


class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 * w in fp32; Gemma 4 style (no "+1" on the weight)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = x.dtype == torch.float32 or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))
        if fused and not x.requires_grad and not _tracing():
            # torch's fused kernel: bit-identical to the lines below in fp32 (pow(2).mean, rsqrt = pow -0.5,
            # two multiplies; tests/unit/model/test_network_norm.py), one dispatch instead of seven. The
            # small models are overhead-bound and run 11 norms per layer. On CUDA also in bf16/fp16 (it
            # computes in fp32 like the lines below): written out, a bf16 norm is nine kernels, ~2,900 of
            # the ~6,000 kernels of one 26B denoise pass. Not in float64 (the parity tests' oracle precision), where
            # its result differs in the last bits, and not under an exporter or compiler (ONNX opset 20
            # has no aten::rms_norm; inductor fuses the written-out ops itself).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def embedding(num: int, dim: int) -> nn.Embedding:
    """`nn.Embedding(num, dim)` that stays cheap on the meta device.

    nn.Embedding's own init runs `normal_`, whose meta-tensor kernel is a `torch._refs` decomposition
    that imports `torch._dynamo` (~2.5 s of a cold start). The weight is allocated here instead (under a
    `torch.device(...)` context like any factory call) and drawn only when it has storage: a CPU/CUDA
    model gets the same normal(0, 1) draws as nn.Embedding, a meta model none.
    """
    weight = torch.empty(num, dim)
    if not weight.is_meta:
        nn.init.normal_(weight)
    return nn.Embedding(num, dim, _weight=weight)


LM_HEAD_SLICE_BYTES = 2 << 20  # CPU LM head: logits computed and softcapped a 2 MB vocabulary slice at a time


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# a fused form of gelu_tanh(gate) * up: (gate, up) -> the product in gate's dtype
GegluKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# a fused form of `layer_end`: (residual, dense, moe, its three norms, scale) -> the layer's output
LayerEndKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, tuple[RMSNorm, RMSNorm, RMSNorm], torch.Tensor], torch.Tensor
]

# a fused form of `ffn_inputs`: (layer, h, attention output) -> (residual, MLP, experts and router inputs);
# the MLP's and the experts' input may come as the quantized operand their GEMMs read, where the GPU loader
# made both ends agree (`pipeline.runtime.kernels.chains.ffn_inputs`)
FfnInputsKernel = Callable[
    ["DecoderLayer", torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor | QuantizedRows, torch.Tensor | QuantizedRows, torch.Tensor],
]

# linears that read one input, computed together (`pipeline.runtime.shared_input`): (x[, its norm]) -> each
# linear's output of x, or of norm(x)
SharedInputKernel = Callable[..., tuple[torch.Tensor, ...]]


def gate_and_up(mlp: GatedMLP | SelfConditioning, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's two input projections of x: by its `gate_up_kernel` where the GPU loader set one (one
    input quantization and, where the weights allow, one GEMM), else by `gate_proj` and `up_proj`."""
    if mlp.gate_up_kernel is not None and not _tracing():
        gate, up = mlp.gate_up_kernel(x)
        return gate, up
    return mlp.gate_proj(x), mlp.up_proj(x)


def geglu(gate: torch.Tensor, up: torch.Tensor, kernel: GegluKernel | None = None) -> torch.Tensor:
    """The gated GeLU of the MLPs and experts; `kernel`: a fused form (`pipeline.runtime.kernels.chains.geglu`,
    one pass where torch's form is two: the GeLU, then the product), kept out of exporters and compilers."""
    if kernel is not None and not _tracing():
        return kernel(gate, up)
    return gelu_tanh(gate) * up


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.geglu_kernel: GegluKernel | None = None  # CUDA: set by the GPU loader where probed
        self.gate_up_kernel: SharedInputKernel | None = None  # likewise (`gate_and_up`)
        # down(gelu_tanh(gate) * up) from (gate, up) with the down projection's operand made by the gated GeLU
        # kernel (`pipeline.runtime.tensor_cores.down_from_geglu`: FP8 or NVFP4); likewise
        self.down_kernel: GegluKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_and_up(self, x)
        if self.down_kernel is not None and not _tracing():
            return self.down_kernel(gate, up)
        return self.down_proj(geglu(gate, up, self.geglu_kernel))


def rope_inv_freq(cfg: TextConfig, layer_type: str, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, always head_dim/2 long: "proportional" RoPE rotates the first
    partial_rotary_factor of each half and leaves the rest with frequency 0 (cos 1, sin 0).

    Always computed on the CPU (a float `arange` on the meta device imports `torch._dynamo`)."""
    p = cfg.rope_parameters[layer_type]
    cpu = torch.device("cpu")
    if p.rope_type == "proportional":
        angles = int(p.partial_rotary_factor * head_dim // 2)
        steps = torch.arange(0, 2 * angles, 2, dtype=torch.float, device=cpu)
        rotated = 1.0 / (p.rope_theta ** (steps / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, device=cpu)])
    dim = int(head_dim * p.partial_rotary_factor)
    return 1.0 / (p.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=cpu) / dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D] rotated by its positions' cos/sin [B, L, D]."""
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


FUSED_GQA_MAX_HEAD_DIM = 256  # the largest head_dim torch's flash attention kernel takes


@contextlib.contextmanager
def attention_kernels(device: torch.device) -> Iterator[None]:
    """Where a pass's attention may run: on CUDA any SDPA kernel torch has enabled but cuDNN's (the flags
    of `torch.backends.cuda`; cuDNN's restored after). torch puts cuDNN first on sm90 and sm100
    (`check_prefer_cudnn_attention` in `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`), and cuDNN's
    attention builds an execution plan on the host for every new problem: the plan cache is keyed on the
    batch and the key length among the rest (`MHAParams`, `aten/src/ATen/native/cudnn/MHA.cpp`). A server
    meets new ones all the time: every round's key lengths until the sliding ring is full, every prompt
    length, every batch of rows. Public reports put
    a build at hundreds of milliseconds, where the sliding layers' attention kernels took 0.05 ms a layer at
    one canvas and 0.14 ms at 16 on an H200: one build costs more than any kernel's edge saves over hundreds
    of passes (docs/engine.md, "Attention without cuDNN's plans"). The CPU takes what torch picks."""
    cuda = torch.backends.cuda
    if device.type != "cuda" or not cuda.cudnn_sdp_enabled():
        yield
        return
    cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        cuda.enable_cudnn_sdp(True)


def packs_queries(device: torch.device, head_dim: int, groups: int, masked: bool = False) -> bool:
    """Whether `attend` runs grouped K/V as an ungrouped attention over the K/V heads (`attend_packed`). On
    CUDA, without cuDNN (`attention_kernels`), torch's SDPA runs grouped K/V (`enable_gqa`) in a fused kernel
    only through flash, which takes head_dim <= 256 and no mask; the memory-efficient kernel takes larger
    heads and masks but (torch 2.11) not groups, so a grouped head_dim-512 layer (the 26B's global layers: 16
    query heads on 2 K/V heads), or any grouped layer with a mask (a batch of rows of different lengths, a
    causal pass), falls to the math path, two batched GEMMs with the score matrix in memory: on an H200 2.69
    ms a layer at 16 canvases, against 0.51 ms on the memory-efficient kernel with K/V copied out to every
    query head (BENCHMARKS.md, "26B-A4B denoise pass"). The packed form runs on that kernel too, with the
    same programs over the same score tiles, but reads each K/V head once instead of a copy per query head.
    A torch built without flash attention (its Windows wheels) packs every grouped layer. The CPU keeps the
    grouped form."""
    if device.type != "cuda" or groups <= 1:
        return False
    return (
        masked or head_dim > FUSED_GQA_MAX_HEAD_DIM or not torch.backends.cuda.is_flash_attention_available()
    )


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention (scale 1: q and k are RMS-normed) of q [B, H, Q, D] over k/v
    [B, H_kv, K, D], grouped or packed as `packs_queries` says; the two compute the same attention. On CUDA
    inside `attention_kernels` (every pass of the network is)."""
    groups = q.shape[1] // k.shape[1]
    if packs_queries(q.device, q.shape[-1], groups, mask is not None):
        return attend_packed(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=groups > 1)


def attend_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped attention as an ungrouped one over the K/V heads: query head h reads K/V head h // groups, so a
    K/V head's query heads are stacked along the queries ([B, H_kv, groups * Q, D]) and each query keeps its
    mask row (as the additive mask torch's SDPA makes of a boolean one: 0 where visible, -inf elsewhere). K and
    V are read where they lie, once per K/V head; q (a view where it is contiguous [B, H, Q, D], as the
    head-norms kernel writes it for this form), the mask and the output are copied, each once (the
    output [B, H, Q, D] as the transpose of a contiguous [B, Q, H, D], which `o_proj` reads without a copy;
    the mask [B, 1, Q, K] in the packed queries' order, its rows 8 values apart: torch's memory-efficient
    kernel copies a bias whose strides are not multiples of 8 into one that is, `preprocess_mask` in
    `aten/src/ATen/native/transformers/attention.cpp`, and most key lengths are not).
    The cost of a copy of K/V per query head (`repeat_interleave`) is then (H - H_kv) heads' K/V written and
    read again, against q's and the output's H heads over Q: less wherever the keys outnumber the queries
    (every denoise pass over a cached context)."""
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    packed = q.reshape(b, kv_heads, groups * n, d)
    if mask is not None:
        rows = mask[:, :, None].expand(-1, -1, groups, -1, -1)  # [B, 1, groups, Q, K], a view
        keys = mask.shape[-1]
        additive = q.new_full((b, 1, groups, n, -(-keys // 8) * 8), float("-inf"))[..., :keys]
        mask = additive.masked_fill_(rows, 0.0).flatten(2, 3)  # a view: its rows stay 8 values apart
    out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=1.0)
    return (
        out.unflatten(2, (groups, n)).permute(0, 3, 1, 2, 4).contiguous().view(b, n, heads, d).transpose(1, 2)
    )


@dataclass
class LayerInputs:
    """What one layer type needs for a pass: RoPE tables for the queries/new keys and the boolean mask
    [B, 1, Q, Kpast + Q] (True = may attend; None = everything is visible)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None


# a fused form of the K/V concatenation: (cached K, cached V, new K, new V) -> (all K, all V) (`cat_kv`)
KVCatKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def cat_kv(
    past_k: torch.Tensor, past_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached K/V, then the new, along the tokens ([B, H, tokens, D])."""
    return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)


class PastWithRoom(NamedTuple):
    """A layer's cached K/V with room after them for a pass's own: [B, H, length + room, D] views of a cache's
    buffers (`KVCache.read` with `room`) whose first `length` tokens are the cached ones. Attention writes
    the new tokens' K/V into the room and reads the whole in place: no concatenation copying the cached
    context each pass."""

    k: torch.Tensor
    v: torch.Tensor
    length: int


def room_for(
    past: tuple[torch.Tensor, torch.Tensor] | PastWithRoom | None, tokens: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The room a cache left after the cached K/V for exactly `tokens` new ones ([B, H, tokens, D] views of
    its K and V buffers), or None."""
    if not isinstance(past, PastWithRoom) or past.k.shape[2] - past.length != tokens:
        return None
    return past.k[:, :, past.length :], past.v[:, :, past.length :]


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, idx: int) -> None:
        super().__init__()
        shape = cfg.layer_shape(idx)
        self.is_sliding = shape.is_sliding
        self.head_dim = shape.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = shape.num_kv_heads
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = (
            nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
            if self.is_sliding
            else None
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        # `apply_rope` as one fused CUDA kernel (`pipeline.runtime.kernels.chains`), set by the GPU loader where
        # its probe found it equal to the torch form; None: the torch form (five element-wise kernels)
        self.rope_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # the cached and new K/V concatenated, K and V in one fused CUDA kernel (`kernels.chains.kv_cat`), set by
        # the GPU loader where probed; None: torch.cat, one launch each
        self.kv_cat_kernel: KVCatKernel | None = None
        # q, k and v projected from one quantization of x (`pipeline.runtime.shared_input`), set by the GPU
        # loader for quantized linears; None: each projection quantizes x itself
        self.qkv_kernel: SharedInputKernel | None = None
        # q's, k's and v's norms and q's and k's RoPE as one fused CUDA kernel (k's and v's alone for
        # `project_kv`; `pipeline.runtime.kernels.chains.head_norms`), set by the GPU loader where probed; None:
        # torch's norms and `rotate`
        self.head_norms_kernel: HeadNormsKernel | None = None

    def rotate(self, x: torch.Tensor, li: LayerInputs) -> torch.Tensor:
        """q or k [B, L, heads, D] rotated by the layer kind's RoPE."""
        if self.rope_kernel is not None and not _tracing():
            return self.rope_kernel(x, li.cos, li.sin)
        return apply_rope(x, li.cos, li.sin)

    def forward(
        self,
        x: torch.Tensor,
        li: LayerInputs,
        past: tuple[torch.Tensor, torch.Tensor] | PastWithRoom | None,
        norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention over x (`norm`: x is the layer's un-normed input and this its input norm, which a fused
        projection can compute with its quantization)."""
        b, q_len, _ = x.shape
        room = room_for(past, q_len)
        q, new_kv = self.normed_qkv(*self.project(x, norm), li, room)
        k, v = new_kv
        if room is not None:  # the new K/V went into the cache's room: attention reads its buffers in place
            k, v = past.k, past.v
        elif past is not None:
            k, v = self.after_past(past, k, v)
        out = attend(q, k, v, li.mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1)), new_kv

    def after_past(
        self, past: tuple[torch.Tensor, torch.Tensor] | PastWithRoom, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads: the cached ones, then the new ones ([B, kv_heads, tokens, D]:
        `cat_kv`), in the cache's own buffers where it left room for exactly the new ones."""
        if isinstance(past, PastWithRoom):  # room for other than the new tokens: the cached ones alone
            past = (past.k[:, :, : past.length], past.v[:, :, : past.length])
        if self.kv_cat_kernel is not None and not _tracing():
            return self.kv_cat_kernel(past[0], past[1], k, v)
        return cat_kv(past[0], past[1], k, v)

    def project(
        self, x: torch.Tensor, norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x's q, k and v projections, or norm(x)'s (v None where the layer has no `v_proj`: K doubles as V)."""
        if self.qkv_kernel is not None and not _tracing():
            q, k, *v = self.qkv_kernel(x, norm)
            return q, k, v[0] if v else None
        x = x if norm is None else norm(x)
        return self.q_proj(x), self.k_proj(x), None if self.v_proj is None else self.v_proj(x)

    def project_kv(self, x: torch.Tensor, li: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K/V [B, kv_heads, Q, head_dim] (normed, K rotated): what a cache keeps."""
        return self.normed_kv(self.k_proj(x), None if self.v_proj is None else self.v_proj(x), li)

    def normed_qkv(
        self,
        q_proj: torch.Tensor,
        k_proj: torch.Tensor,
        v_proj: torch.Tensor | None,
        li: LayerInputs,
        room: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """q [B, heads, Q, head_dim] normed and rotated, and the new tokens' K/V as `normed_kv` makes them, from
        the projections [B, Q, heads * head_dim]: one fused kernel for the three where installed. `room`: the
        K/V are written there (a cache's room, `room_for`), and those views returned."""
        b, q_len, _ = q_proj.shape
        q_raw = q_proj.view(b, q_len, self.num_heads, self.head_dim)
        if self.head_norms_kernel is None or _tracing():
            kv = self.normed_kv(k_proj, v_proj, li)
            if room is not None:
                room[0].copy_(kv[0])
                room[1].copy_(kv[1])
            return self.rotate(self.q_norm(q_raw), li).transpose(1, 2), room or kv
        k_raw, v_raw = self.kv_heads(k_proj, v_proj)
        # q head-major where `attend` packs it: then its packing is a view, not a copy
        groups = self.num_heads // self.num_kv_heads
        head_major = packs_queries(q_proj.device, self.head_dim, groups, li.mask is not None)
        k, v, q = self.head_norms_kernel(
            k_raw, self.k_norm, li.cos, li.sin, v_raw, self.v_norm, q_raw, self.q_norm, q_head_major=head_major,
            out=room,
        )  # fmt: skip
        return q if head_major else q.transpose(1, 2), room or (k.transpose(1, 2), v.transpose(1, 2))

    def normed_kv(
        self, k_proj: torch.Tensor, v_proj: torch.Tensor | None, li: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`project_kv` from the projections [B, Q, kv_heads * head_dim]."""
        k_raw, v_raw = self.kv_heads(k_proj, v_proj)
        if self.head_norms_kernel is not None and not _tracing():
            k, v, _ = self.head_norms_kernel(k_raw, self.k_norm, li.cos, li.sin, v_raw, self.v_norm)
        else:
            k, v = self.rotate(self.k_norm(k_raw), li), self.v_norm(v_raw)
        return k.transpose(1, 2), v.transpose(1, 2)

    def kv_heads(
        self, k_proj: torch.Tensor, v_proj: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K's and V's heads [B, Q, kv_heads, head_dim] of their projections (K's where the layer has no
        `v_proj`: K doubles as V, before its norm and rotation)."""
        b, q_len, _ = k_proj.shape
        k_raw = k_proj.view(b, q_len, self.num_kv_heads, self.head_dim)
        return k_raw, k_raw if v_proj is None else v_proj.view(b, q_len, self.num_kv_heads, self.head_dim)


class Router(nn.Module):
    """Routes on the raw residual (not the normed FFN input): RMSNorm(no scale) * scale * d^-0.5."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.top_k = cfg.top_k_experts
        self.root = d**-0.5
        self.norm = RMSNorm(d, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(d, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(d))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        # norm(x) * scale * root as one fused CUDA kernel (`pipeline.runtime.kernels.chains.scale_columns`),
        # set by the GPU loader where probed; None: torch's two products
        self.scale_kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
        # `route_scores`' top-k weights and experts as one fused CUDA kernel
        # (`pipeline.runtime.kernels.routing.top_k`), set by the GPU loader where probed; None: torch's six
        self.top_k_kernel: TopKKernel | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.route(self.input(x))

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """What the router's projection reads: norm(x) * scale * d^-0.5."""
        if self.scale_kernel is not None and not _tracing():
            return self.scale_kernel(self.norm(x), self.scale, self.root)
        return self.norm(x) * self.scale * self.root

    def route(self, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities, top-k weights, top-k experts) from the router's `input`."""
        return route_scores(self.proj(inp), self.top_k, self.per_expert_scale)

    def choose(self, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights, top-k experts) from the router's `input`: what a layer's experts take."""
        scores = self.proj(inp)
        if self.top_k_kernel is not None and not _tracing():
            return self.top_k_kernel(scores, self.top_k, self.per_expert_scale)
        _, weights, index = route_scores(scores, self.top_k, self.per_expert_scale)
        return weights, index


# a fused form of attention's head norms: (x, its norm, cos, sin[, v, v's norm[, q, q's norm]]) ->
# (rope(norm(x)), v_norm(v) or None, rope(q_norm(q)) or None)
HeadNormsKernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]

# a fused form of `route_scores`' weights and experts: (scores, k, per-expert scale) -> (weights, experts)
TopKKernel = Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def route_scores(
    scores: torch.Tensor, k: int, per_expert_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities, top-k weights, top-k experts) from router scores [..., E]: the softmax in fp32, each
    token's k most probable experts, their probabilities renormalised to sum to 1 and times the experts'
    learned scales."""
    probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, k=k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights * per_expert_scale[index], index


# a fused form of the combine: (y, rows of y in token-major slot order or None, weights [T, k]) -> [T, d]
CombineKernel = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


def combine_top_k(
    y: torch.Tensor, routing: ExpertOrder, weights: torch.Tensor, kernel: CombineKernel | None = None
) -> torch.Tensor:
    """Each token's k expert outputs, weighted and summed: `y` holds the routed slots' outputs in `routing`'s
    order (of the token-major [T, k] slots), `weights` [T, k] the router's weights. The rows go back to
    slot order by a row gather and each token's k rows are combined by one batched product: no atomics
    (deterministic), fp32 accumulation, one rounding. On an H200 the scatter-add it replaces on CUDA took
    22 ms of a 141 ms bf16 pass at 16 canvases, and `index_copy_` back to slot order ran at 0.7 TB/s.
    `kernel`: a fused form that reads the rows where they are (`pipeline.runtime.kernels.chains.combine`)."""
    if kernel is not None and not _tracing():
        return kernel(y, slot_rows(routing), weights)
    return combine_slots(y.index_select(0, slot_rows(routing)), weights)


def combine_slots(
    per_slot: torch.Tensor, weights: torch.Tensor, kernel: CombineKernel | None = None
) -> torch.Tensor:
    """`combine_top_k` of outputs already in token-major slot order ([T * k, d]: a GEMM that wrote its rows
    there, `pipeline.runtime.kernels.moe`'s `out_rows`)."""
    if kernel is not None and not _tracing():
        return kernel(per_slot, None, weights)
    (t, k), d = weights.shape, per_slot.shape[-1]  # d named: a view cannot infer it from 0 tokens
    return torch.bmm(weights.reshape(t, 1, k).to(per_slot.dtype), per_slot.view(t, k, d)).view(t, d)


# torch's `F.grouped_mm` has a CUDA kernel for bf16 on compute capability 9.x and 10.x only (the gate is
# `_scaled_mm_allowed_device(sm90_only, sm100_only)` in aten/src/ATen/native/cuda/GroupedBlas.cpp). Anywhere
# else it runs `_grouped_mm_fallback` (aten/src/ATen/native/GroupedMMUtils.h): the group offsets copied to
# the host, then one matmul per group. Correct, but a host sync inside the step, which a CUDA graph cannot
# capture: on an Ada (sm89) or RTX Blackwell (sm120) GPU a bf16 model's denoise steps run eagerly.
GROUPED_MM_KERNEL_MAJORS = (9, 10)


def grouped_mm_reads_host(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` on `device` and `dtype` reads its offsets on the host (its fallback loop)."""
    if device.type != "cuda":
        return False
    return (
        dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] not in GROUPED_MM_KERNEL_MAJORS
    )


def grouped_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    combine: CombineKernel | None = None,
    geglu_kernel: GegluKernel | None = None,
    order_kernel: OrderKernel | None = None,
) -> torch.Tensor:
    """Routed experts as grouped GEMMs: the slots (token, choice) sorted by expert, one grouped GEMM per
    projection, the rows added back per token in expert order (CPU; CUDA: `combine_top_k`). `gate_up`
    [E, 2I, d], `down` [E, d, I]."""
    routing = expert_order(index, gate_up.shape[0], order_kernel)
    offs = routing.offs
    gate, up = F.grouped_mm(x[routing.token_of], gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(geglu(gate, up, geglu_kernel), down.transpose(-2, -1), offs=offs)
    if x.is_cuda:  # atomics there add in no fixed order anyway
        return combine_top_k(y, routing, weights, combine).to(x.dtype)
    w_sorted = weights.reshape(-1)[routing.order]
    return torch.zeros_like(x).index_add_(0, routing.token_of, (y * w_sorted[:, None]).to(x.dtype))


class Experts(nn.Module):
    """Expert weights as 3-D tensors ([E, 2I, d] fused gate|up, [E, d, I] down), as transformers stores them.

    Neither form below synchronises with the host itself (no `.tolist()`, no data-dependent shapes), so a
    denoise step can be captured in a CUDA graph and the CPU never waits on routing, except where torch's
    grouped GEMM has no CUDA kernel and its fallback does (`grouped_mm_reads_host`):
      * grouped (the default wherever torch has a `grouped_mm` kernel: CPU fp32/bf16/fp16, CUDA bf16/fp16,
        sizes 16-byte aligned): tokens sorted by expert, one grouped GEMM per projection, the results
        added back per token in expert order;
      * dense (everything else: float64 for the parity tests, CUDA fp32, unaligned sizes): every expert on
        every token, weighted by the router weight scattered into [T, E] (0 where not selected). Exact
        (an unselected expert adds 0) but E/top_k times the routed compute.
    On the CPU both add a token's experts in increasing expert order, as transformers' expert loop does; on
    CUDA the grouped form combines a token's k rows in one batched product (`combine_top_k`)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.grouped: bool | None = None  # None: grouped GEMM where torch has a kernel for it
        self.combine_kernel: CombineKernel | None = None  # CUDA: set by the GPU loader where probed
        self.geglu_kernel: GegluKernel | None = None  # likewise
        self.order_kernel: OrderKernel | None = None  # likewise

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.grouped is not None:
            return self.grouped
        aligned = all(n * x.element_size() % 16 == 0 for n in self.down_proj.shape[1:])
        kinds = (
            (torch.bfloat16, torch.float16) if x.is_cuda else (torch.float32, torch.bfloat16, torch.float16)
        )
        return x.device.type in ("cpu", "cuda") and x.dtype in kinds and aligned

    # set by `pipeline.runtime.compiled` to its `dgpipe::routed_experts` custom op: under torch.compile the
    # grouped path of a dtype other than bf16 runs as that one opaque op (torch's fake kernel for grouped_mm
    # takes bf16 only); bf16 is traced, its fused kernels (gated GeLU, expert order, combine) with it
    compiled_op: ClassVar[Callable[..., torch.Tensor] | None] = None

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if not self.use_grouped(x):
            return self._dense(x, index, weights)
        if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
            if Experts.compiled_op is None:
                return self._dense(x, index, weights)
            return Experts.compiled_op(x, index, weights, self.gate_up_proj, self.down_proj)
        return grouped_experts(
            x, index, weights, self.gate_up_proj, self.down_proj, self.combine_kernel, self.geglu_kernel,
            self.order_kernel,
        )  # fmt: skip

    def _dense(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dense_w = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense_w = dense_w.scatter_add(1, index, weights)  # add: an index naming an expert twice counts twice
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(gelu_tanh(gate) * up, self.down_proj[e]) * dense_w[:, e, None]
            out += y.to(out.dtype)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, idx: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[idx]  # type: ignore[index]
        self.self_attn = Attention(cfg, idx)
        self.mlp = GatedMLP(d, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            setattr(self, name, RMSNorm(d, eps))
        # fixed per-layer output scale; transformers keeps one copy per mode (the two are not tied)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        # the residual sum and the layer scale, (residual + x) * scale, as one fused CUDA kernel
        # (`pipeline.runtime.kernels.chains.add_scaled`), set by the GPU loader where probed; None: torch's two
        self.residual_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # `layer_end` (three norms, two sums and the scale: five kernels) as one fused CUDA kernel
        # (`pipeline.runtime.kernels.chains.layer_end`), set by the GPU loader where probed
        self.end_kernel: LayerEndKernel | None = None
        # `ffn_inputs` (a norm, the residual sum, the three FFN input norms and the router's scales: six
        # kernels) as one fused CUDA kernel (`pipeline.runtime.kernels.chains.ffn_inputs`), likewise
        self.ffn_inputs_kernel: FfnInputsKernel | None = None

    def forward(
        self,
        h: torch.Tensor,
        li: LayerInputs,
        past: tuple[torch.Tensor, torch.Tensor] | PastWithRoom | None,
        encoder: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        a, new_kv = self.self_attn(h, li, past, self.input_layernorm)
        if self.ffn_inputs_kernel is not None and not _tracing():
            residual, mlp_in, experts_in, router_in = self.ffn_inputs_kernel(self, h, a)
        else:
            residual, mlp_in, experts_in, router_in = ffn_inputs(self, h, a)
        dense = self.mlp(mlp_in)
        weights, index = self.router.choose(router_in)
        moe = self.experts(experts_in, index, weights).reshape(residual.shape)
        scale = self.encoder_layer_scalar if encoder else self.layer_scalar
        norms = (
            self.post_feedforward_layernorm_1,
            self.post_feedforward_layernorm_2,
            self.post_feedforward_layernorm,
        )
        if self.end_kernel is not None and not _tracing():
            return self.end_kernel(residual, dense, moe, norms, scale), new_kv
        return layer_end(residual, dense, moe, norms, scale, self.residual_kernel), new_kv


def ffn_inputs(
    layer: DecoderLayer, h: torch.Tensor, attn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a decoder layer's FFN branches read after attention, all from the residual stream
    h + post_attention_layernorm(attn) [..., d]: that residual, then `ffn_norms` of it."""
    return ffn_norms(layer, h + layer.post_attention_layernorm(attn))


def ffn_norms(
    layer: DecoderLayer, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual stream [..., d] after attention, the dense MLP's input (its shape), and as [tokens, d]
    rows the experts' input and the router's input (`Router.input`)."""
    flat = residual.reshape(-1, residual.shape[-1])
    mlp_in = layer.pre_feedforward_layernorm(residual)
    return residual, mlp_in, layer.pre_feedforward_layernorm_2(flat), layer.router.input(flat)


def layer_end(
    residual: torch.Tensor,
    dense: torch.Tensor,
    moe: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm, RMSNorm],
    scale: torch.Tensor,
    residual_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A decoder layer's output from its dense MLP's and experts' outputs: (residual + norm(norm_1(dense) +
    norm_2(moe))) * scale, `norms` = (norm_1, norm_2, norm); `residual_kernel`: a fused form of the last sum
    and product (`pipeline.runtime.kernels.chains.add_scaled`)."""
    dense_norm, moe_norm, ffn_norm = norms
    ffn = ffn_norm(dense_norm(dense) + moe_norm(moe))
    if residual_kernel is not None and not _tracing():
        return residual_kernel(residual, ffn, scale)
    return (residual + ffn) * scale


class SelfConditioning(nn.Module):
    """Gated MLP on the previous step's soft embedding, added to the canvas embedding, then RMS-normed."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.pre_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps, with_scale=False)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.geglu_kernel: GegluKernel | None = None  # CUDA: set by the GPU loader where probed
        self.gate_up_kernel: SharedInputKernel | None = None  # likewise (`gate_and_up`)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # first step: the MLP of a zero signal is exactly zero
            return self.post_norm(embeds)
        h = geglu(*gate_and_up(self, self.pre_norm(soft)), self.geglu_kernel)
        return self.post_norm(embeds + self.down_proj(h))


class DiffusionGemma(nn.Module):
    """The shared-weight encoder/decoder. Passes are pure functions of (tokens, positions, masks, past K/V)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.text_config
        self.config = config
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.layer_types: list[str] = list(cfg.layer_types)  # type: ignore[arg-type]
        # the LM head's softcap as one fused CUDA kernel (`pipeline.runtime.kernels.chains.softcap`), set by
        # the GPU loader where its probe passed; None: torch's four passes over the logits
        self.softcap_kernel: Callable[[torch.Tensor, float], torch.Tensor] | None = None
        for kind in sorted(set(self.layer_types)):
            hd = cfg.layer_shape(self.layer_types.index(kind)).head_dim
            # computed on the CPU, then placed where a `with torch.device(...)` block puts everything else
            inv_freq = rope_inv_freq(cfg, kind, hd).to(torch.get_default_device())
            self.register_buffer(f"inv_freq_{kind}", inv_freq, persistent=False)

    # ---- building blocks -------------------------------------------------------------------------
    @property
    def embed_scale(self) -> torch.Tensor:
        # sqrt(d) rounded to the weight dtype, as transformers does (55.43 becomes 55.5 in bf16)
        return torch.tensor(self.cfg.hidden_size**0.5, dtype=self.embed_tokens.weight.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) * self.embed_scale

    def rope(
        self, kind: str, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * getattr(self, f"inv_freq_{kind}")
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head, then the final softcap in fp32 (bf16 tanh here visibly changes the sampler).

        Without autograd the softcap runs in place (no [B, L, V] temporaries). On the CPU with fp32
        weights the LM head is computed a slice of the vocabulary at a time into a cache-sized scratch that
        is softcapped while it is still in cache, then copied out: the [tokens, V] output of one big GEMM
        is tens of MB (the medium bench model: 32 MB), written to memory and read back by the softcap's
        three passes, and this BLAS runs that wide-output shape at ~2/3 of its rate on narrower ones.
        Same products, sums and element-wise kernels, so the same values."""
        cap = self.cfg.final_logit_softcapping
        w = self.embed_tokens.weight
        if (torch.is_grad_enabled() and hidden.requires_grad) or _tracing():
            # (traced: the ops as written; compiled: inductor fuses the three into the GEMM epilogue)
            return torch.tanh(F.linear(hidden, w).float() / cap) * cap
        if not hidden.is_cpu or w.dtype != torch.float32:
            if self.softcap_kernel is not None:
                return self.softcap_kernel(F.linear(hidden, w), cap)
            return F.linear(hidden, w).float().div_(cap).tanh_().mul_(cap)
        rows = hidden.reshape(-1, hidden.shape[-1])
        vocab = w.shape[0]
        width = max(256, LM_HEAD_SLICE_BYTES // (4 * rows.shape[0]) // 256 * 256)
        out = torch.empty(rows.shape[0], vocab, dtype=torch.float32, device=hidden.device)
        if width >= vocab:
            torch.mm(rows, w.t(), out=out)
            out.div_(cap).tanh_().mul_(cap)
        else:
            scratch = torch.empty(rows.shape[0], width, dtype=torch.float32, device=hidden.device)
            for v0 in range(0, vocab, width):
                part = scratch[:, : min(width, vocab - v0)]
                torch.mm(rows, w[v0 : v0 + width].t(), out=part)
                out[:, v0 : v0 + width].copy_(part.div_(cap).tanh_().mul_(cap))
        return out.view(*hidden.shape[:-1], vocab)

    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """Self-conditioning input: softmax(previous scaled logits) @ E * sqrt(d), in the weight dtype.

        The op transformers runs inside its forward; the serving runtime runs it right after sampling
        instead and keeps only this [B, L, hidden] result between steps, not the [B, L, vocab] probs."""
        w = self.embed_tokens.weight
        return torch.matmul(probs.to(w.dtype), w) * self.embed_scale.to(w.dtype)

    def layer_inputs(
        self, positions: torch.Tensor, masks: dict[str, torch.Tensor | None], dtype: torch.dtype
    ) -> dict[str, LayerInputs]:
        return {
            kind: LayerInputs(*self.rope(kind, positions, dtype), mask=masks[kind])
            for kind in set(self.layer_types)
        }

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        encoder: bool,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """All layers plus the final norm; returns the hidden states and each layer's new (K, V)."""
        inputs = self.layer_inputs(positions, masks, h.dtype)
        new_kv = []
        with attention_kernels(h.device):
            for i, layer in enumerate(self.layers):
                h, kv = layer(h, inputs[self.layer_types[i]], past[i] if past is not None else None, encoder)
                new_kv.append(kv)
        return self.norm(h), new_kv

    # ---- the three passes --------------------------------------------------------------------------
    def encode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Causal pass (prefill, commit, AR decoding): hidden states and the K/V to write to the cache."""
        return self.run_layers(self.embed(tokens), positions, masks, past, encoder=True)

    def encode_kv(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`encode`'s K/V only (prefill, commit): the last layer's attention output, FFN and the final norm
        feed nothing a cache keeps, so they are skipped. The same ops as `encode` for what it computes."""
        h = self.embed(tokens)
        inputs = self.layer_inputs(positions, masks, h.dtype)
        new_kv = []
        with attention_kernels(h.device):
            for i, layer in enumerate(self.layers[:-1]):
                h, kv = layer(h, inputs[self.layer_types[i]], past[i] if past is not None else None, True)
                new_kv.append(kv)
        last = self.layers[-1]
        new_kv.append(last.self_attn.project_kv(last.input_layernorm(h), inputs[self.layer_types[-1]]))
        return new_kv

    def denoise(
        self,
        canvas: torch.Tensor,
        sc_probs: torch.Tensor | None,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """Bidirectional pass over the canvas reading the context K/V; returns fp32 softcapped logits.
        `sc_probs`: the previous step's probabilities, as transformers takes them (None: no signal)."""
        soft = self.soft_embedding(sc_probs) if sc_probs is not None else None
        return self.denoise_soft(canvas, soft, positions, masks, past)

    def denoise_soft(
        self,
        canvas: torch.Tensor,
        soft: torch.Tensor | None,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """`denoise` from the soft embedding itself ([B, L, hidden], `soft_embedding` of the probs): the
        runtime's compact self-conditioning state."""
        x = self.embed(canvas)
        h, _ = self.run_layers(self.self_conditioning(x, soft), positions, masks, past, encoder=False)
        return self.logits(h)

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init for training from scratch and for tests (normal(0, std), norms at 1)."""
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, std, generator=generator)
            else:
                nn.init.ones_(p)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def canvas_positions(start: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] absolute positions of a block starting at each row's committed length."""
    return start[:, None] + torch.arange(length, device=start.device)[None, :]
