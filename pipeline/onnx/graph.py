"""The network as one exportable function of (mode, tokens, positions, sc_embed, masks, past K/V).

`pipeline.model.network.DiffusionGemma` is written for eager PyTorch: `encode`/`denoise` are separate methods, SDPA
takes an optional mask, and the MoE sorts tokens by expert for a grouped GEMM (`F.grouped_mm`, no ONNX equivalent),
none of which a static graph can express. `GraphModel` runs the SAME modules and weights with graph-friendly
control flow:
  * `mode` (0 causal, 1 denoise) selects the input path and the layer scalars with `Where`, so one graph
    serves both passes (pipeline.onnx.contract explains why);
  * the self-conditioning MLP runs on sc_embed's own rows (the soft embedding softmax(z) @ E * sqrt(d),
    computed after the previous step's sampler: pipeline.onnx.export) and is gathered to the canvas rows
    (`min(arange(seq), sc_seq - 1)`), so a [B, 1, hidden] zero row costs one row, not [B, S, hidden];
  * attention is written out (QK^T with scale 1, boolean mask, softmax, V) with GQA by expansion;
  * the MoE, `moe="routed"` (default): the router in plain ops (softmax, TopK, renormalise) then ONE
    `dgpipe::MoE` node per layer (`pipeline.onnx.moe`: routed FLOPs; a TensorRT plugin in the engine, a
    reference function in onnxruntime). `moe="dense"` (debugging, and quantized exports until the MoE node
    takes packed experts): every expert on every token, unrolled per expert, weighted by the router's
    renormalised top-k weights scattered into a dense [T, E] matrix (zero for unselected experts) - exact
    and static, but E/top_k times the routed expert compute.
It returns the final-normed hidden states; the LM head and the sampler ops are appended in ONNX
(`pipeline.onnx.export`) because their row count depends on `mode`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.network import Attention, DecoderLayer, DiffusionGemma, gelu_tanh, rotate_half
from pipeline.onnx import contract as onnx_io
from pipeline.onnx.moe import RoutedMoE

# (module path, input) -> output: lets the FP8 exporter swap plain linears for Q/DQ ones
LinearFn = Callable[[str, torch.Tensor], torch.Tensor]
# layer index -> (gate_up [E, 2I, d], down [E, d, I], input_scale [3, E] or None, act_quant): the routed
# node's expert inputs when they are not the float parameters (the FP8 / NVFP4 exporters' stand-ins, replaced
# by DQ afterwards) and the activation format ("fp8", "nvfp4") input_scale belongs to
ExpertsFn = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str]]


class GraphModel(nn.Module):
    def __init__(
        self,
        model: DiffusionGemma,
        linear: LinearFn | None = None,
        moe: str = "dense",
        experts: ExpertsFn | None = None,
    ) -> None:
        super().__init__()
        if moe == "routed" and linear is not None and experts is None:
            raise ValueError("a routed MoE with quantized linears needs the stacked expert inputs (experts=)")
        self.model = model
        self.layer_types = list(model.layer_types)
        self._linear = linear
        self._experts = experts
        self.routed = moe == "routed"

    def linear(self, path: str, x: torch.Tensor) -> torch.Tensor:
        if self._linear is not None:
            return self._linear(path, x)
        return F.linear(x, self.model.get_submodule(path).weight)

    # ---- blocks --------------------------------------------------------------------------------------
    def attention(
        self,
        path: str,
        attn: Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s = x.shape[0], x.shape[1]
        h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        q = attn.q_norm(self.linear(f"{path}.q_proj", x).reshape(b, s, h, hd))
        q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
        k_raw = self.linear(f"{path}.k_proj", x).reshape(b, s, kvh, hd)
        v_raw = self.linear(f"{path}.v_proj", x).reshape(b, s, kvh, hd) if attn.v_proj is not None else k_raw
        k = attn.k_norm(k_raw)
        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)
        v = attn.v_norm(v_raw).transpose(1, 2)
        keys = torch.cat([past_k, k], dim=2)
        values = torch.cat([past_v, v], dim=2)
        if kvh != h:  # query head j reads kv head j // (h / kvh), as SDPA's enable_gqa does
            n = keys.shape[2]
            keys = keys[:, :, None].expand(b, kvh, h // kvh, n, hd).reshape(b, h, n, hd)
            values = values[:, :, None].expand(b, kvh, h // kvh, n, hd).reshape(b, h, n, hd)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float()  # attention scale 1.0 (q, k are normed)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(b, s, h * hd)
        return self.linear(f"{path}.o_proj", out), k, v

    def mlp(self, path: str, x: torch.Tensor) -> torch.Tensor:
        gate = self.linear(f"{path}.gate_proj", x)
        return self.linear(f"{path}.down_proj", gelu_tanh(gate) * self.linear(f"{path}.up_proj", x))

    def moe(self, path: str, layer: DecoderLayer, flat: torch.Tensor) -> torch.Tensor:
        _, weights, index = layer.router(flat)
        if self.routed:
            x = layer.pre_feedforward_layernorm_2(flat)
            if self._experts is None:
                gate_up, down, scale, act = layer.experts.gate_up_proj, layer.experts.down_proj, None, "none"
            else:
                gate_up, down, scale, act = self._experts(int(path.split(".")[1]))
            act_id = onnx_io.MOE_ACT_QUANT.index(act)
            return RoutedMoE.apply(x, index, weights, gate_up, down, layer.router.top_k, scale, act_id)
        dense_w = torch.zeros(
            flat.shape[0], layer.experts.num_experts, dtype=weights.dtype, device=flat.device
        )
        dense_w = dense_w.scatter(1, index, weights)
        x = layer.pre_feedforward_layernorm_2(flat)
        out = torch.zeros_like(flat)
        inner = layer.experts.gate_up_proj.shape[1] // 2
        for e in range(layer.experts.num_experts):
            if self._linear is not None:  # per-expert gate/up/down, as ModelOpt stores quantized experts
                gate = self._linear(f"{path}.experts.{e}.gate_proj", x)
                up = self._linear(f"{path}.experts.{e}.up_proj", x)
                y = self._linear(f"{path}.experts.{e}.down_proj", gelu_tanh(gate) * up)
            else:
                gu = F.linear(x, layer.experts.gate_up_proj[e])
                gate, up = gu[:, :inner], gu[:, inner:]
                y = F.linear(gelu_tanh(gate) * up, layer.experts.down_proj[e])
            out = out + (y * dense_w[:, e : e + 1]).to(out.dtype)
        return out

    # ---- the pass ------------------------------------------------------------------------------------
    def forward(
        self,
        mode: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        sc_embed: torch.Tensor,
        mask_full: torch.Tensor,
        mask_sliding: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        m = self.model
        denoise = mode.reshape(()) != 0
        w = m.embed_tokens.weight
        scale = m.embed_scale.to(w.dtype)
        e = F.embedding(tokens, w) * scale
        # self-conditioning on sc_embed's own rows (1 or seq), then gathered to every canvas row
        sc = m.self_conditioning
        n = sc.pre_norm(sc_embed.to(w.dtype))
        signal = self.mlp("self_conditioning", n)
        last = torch.arange(sc_embed.shape[1], device=tokens.device)[-1]
        rows = torch.minimum(torch.arange(tokens.shape[1], device=tokens.device), last)
        x_denoise = sc.post_norm(e + signal.index_select(1, rows))
        h = torch.where(denoise, x_denoise, e)

        rope = {kind: m.rope(kind, positions, h.dtype) for kind in set(self.layer_types)}
        masks = {"full_attention": mask_full, "sliding_attention": mask_sliding}
        present: list[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            kind = self.layer_types[i]
            path = f"layers.{i}"
            a, k, v = self.attention(
                f"{path}.self_attn",
                layer.self_attn,
                layer.input_layernorm(h),
                *rope[kind],
                masks[kind],
                past[2 * i],
                past[2 * i + 1],
            )
            present += [k, v]
            h = h + layer.post_attention_layernorm(a)
            residual = h
            dense = layer.post_feedforward_layernorm_1(
                self.mlp(f"{path}.mlp", layer.pre_feedforward_layernorm(h))
            )
            flat = residual.reshape(-1, residual.shape[-1])
            moe = self.moe(path, layer, flat).reshape(residual.shape)
            h = residual + layer.post_feedforward_layernorm(dense + layer.post_feedforward_layernorm_2(moe))
            h = h * torch.where(denoise, layer.layer_scalar, layer.encoder_layer_scalar)
        return (*present, m.norm(h))
