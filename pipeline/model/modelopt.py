"""Read a ModelOpt-exported checkpoint into dgpipe's runtime: dequantize weights on load, and hook faithful
activation fake-quantization onto the linears of activation-quantized formats.

Layouts, as `modelopt.torch.export.export_hf_checkpoint` (0.47) writes them per quantized linear:
* FP8:      weight float8_e4m3fn [out, in]; weight_scale fp32 (per tensor); input_scale fp32.
* NVFP4:    weight uint8 [out, in/2], two E2M1 codes per byte, low nibble = even column; weight_scale
            float8_e4m3fn [out, in/16]; weight_scale_2 fp32; input_scale fp32 (= amax / (6 * 448)).
* W4A16_AWQ: weight uint8 [out/2, in], two signed int4 per byte along the OUTPUT dim, low nibble = even
            row; weight_scale [out, in/group] (16-bit); optional pre_quant_scale [in] multiplies the input.
Fused-expert models are exported one 2-D tensor per expert and projection (`experts.E.gate_proj`), which
`pipeline.model.checkpoint` fuses back after dequantization.

Not emulated: an FP8 KV cache (`--kv-cache fp8` exports `k_proj.k_scale` / `v_proj.v_scale` for vLLM and
TensorRT-LLM); dgpipe's CPU runtime reads past them and keeps K/V in the compute dtype.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.errors import CheckpointError
from pipeline.model.fake_quant import E2M1_VALUES, InputQuantizer

AUX_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale")
ACT_FORMAT = {"FP8": "fp8", "NVFP4": "nvfp4"}  # quant_algo -> activation fake-quant (None = weight-only)
SUPPORTED = ("FP8", "NVFP4", "W4A16_AWQ", "INT4_AWQ")
EXPERT = re.compile(r"^(layers\.\d+\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")


def quantization_info(path: Path) -> dict[str, Any] | None:
    """hf_quant_config.json's `quantization` block, else config.json's `quantization_config`; None when
    the checkpoint is not quantized."""
    hq = path / "hf_quant_config.json"
    if hq.is_file():
        return json.loads(hq.read_text()).get("quantization")
    cfg = path / "config.json"
    if cfg.is_file():
        q = json.loads(cfg.read_text()).get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") == "modelopt":
            return q
    return None


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mag = E2M1_VALUES[codes & 0x7]
    return torch.where(codes >= 8, -mag, mag)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[out/2, in] uint8 -> [out, in] int values in [-8, 7] (low nibble = even output row)."""
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    q = torch.stack([lo, hi], dim=1).reshape(packed.shape[0] * 2, packed.shape[1])
    return torch.where(q >= 8, q - 16, q)


def dequantize_weight(algo: str, w: torch.Tensor, get: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
    """One exported weight -> fp32 [out, in]; `get(suffix)` fetches a sibling tensor (or None)."""
    if w.dtype == torch.float8_e4m3fn:
        scale = get("weight_scale")
        s = scale.float() if scale is not None else torch.tensor(1.0)
        return w.float() * (s.reshape(-1, 1) if s.dim() >= 1 and s.numel() == w.shape[0] else s)
    if w.dtype == torch.uint8 and algo == "NVFP4":
        block_scale, global_scale = get("weight_scale"), get("weight_scale_2")
        if block_scale is None or global_scale is None:
            raise CheckpointError("NVFP4 weight without weight_scale / weight_scale_2")
        vals = unpack_e2m1(w)
        block = vals.shape[-1] // block_scale.shape[-1]
        return vals * block_scale.float().repeat_interleave(block, -1) * global_scale.float()
    if w.dtype == torch.uint8 and algo in ("W4A16_AWQ", "INT4_AWQ"):
        scale = get("weight_scale")
        if scale is None:
            raise CheckpointError("INT4 weight without weight_scale")
        q = unpack_int4_rows(w).float()
        group = q.shape[-1] // scale.shape[-1]
        return q * scale.float().repeat_interleave(group, -1)
    if w.dtype == torch.uint8:
        raise CheckpointError(f"packed uint8 weight for unsupported quant_algo {algo!r}")
    return w


class QuantizedLoader:
    """What `pipeline.model.checkpoint.load_model` asks of a quantized checkpoint."""

    def __init__(self, info: dict[str, Any]):
        self.algo = str(info.get("quant_algo"))
        if self.algo not in SUPPORTED:
            raise CheckpointError(
                f"quant_algo {self.algo!r} is not supported by dgpipe's runtime",
                f"supported: {', '.join(SUPPORTED)}",
            )
        self.act = ACT_FORMAT.get(self.algo)
        self.input_scales: dict[str, torch.Tensor] = {}  # runtime module name -> input scale
        self.pre_quant_scales: dict[str, torch.Tensor] = {}

    @staticmethod
    def is_aux(name: str) -> bool:
        return name.rsplit(".", 1)[-1] in AUX_SUFFIXES

    def weight(
        self, runtime_name: str, t: torch.Tensor, fetch: Callable[[str], torch.Tensor | None]
    ) -> torch.Tensor:
        """Dequantize `<module>.weight` and remember the module's activation scales."""
        if not runtime_name.endswith(".weight"):
            return t
        module = runtime_name[: -len(".weight")]
        get = lambda suffix: fetch(suffix)
        for suffix, store in (("input_scale", self.input_scales), ("pre_quant_scale", self.pre_quant_scales)):
            s = get(suffix)
            if s is not None:
                store[module] = s.float()
        return dequantize_weight(self.algo, t, get)

    def install(self, model: torch.nn.Module) -> int:
        """Hook activation quantization onto the runtime model; returns how many projections got one."""
        hooked = 0
        expert_inputs: dict[str, dict[str, list[torch.Tensor]]] = {}
        for name in set(self.input_scales) | set(self.pre_quant_scales):
            m = EXPERT.match(name)
            if m:
                proj = "down" if m.group(2) == "down_proj" else "gate_up"
                d = expert_inputs.setdefault(m.group(1), {})
                if name in self.input_scales:
                    d.setdefault(proj, []).append(self.input_scales[name])
                continue
            module = model.get_submodule(name)
            q = InputQuantizer(self.act, self.input_scales.get(name), self.pre_quant_scales.get(name))
            if q.kind is None and q.pre_quant_scale is None:
                continue
            module.register_forward_pre_hook(lambda _m, args, q=q: (q(args[0]), *args[1:]))
            hooked += 1
        if self.act is not None:
            for prefix, scales in expert_inputs.items():
                # ModelOpt shares one input quantizer per projection across the experts of a layer (and
                # vLLM takes the max over experts): one scale per projection
                quants = {p: InputQuantizer(self.act, torch.stack(v).max()) for p, v in scales.items()}
                experts = model.get_submodule(prefix)
                experts.forward = types.MethodType(_quantized_experts_forward(quants), experts)
                hooked += len(quants)
        return hooked


def _quantized_experts_forward(quants: dict[str, InputQuantizer]):
    """`pipeline.model.network.Experts.forward` with the gate_up and down inputs fake-quantized."""
    from pipeline.model.network import gelu_tanh

    ident = lambda x: x
    q_in, q_down = quants.get("gate_up", ident), quants.get("down", ident)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_expert = index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        token_of = order // index.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            gate, up = F.linear(q_in(x[tok]), self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(q_down(gelu_tanh(gate) * up), self.down_proj[e]) * w_sorted[start : start + n, None]
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        return out

    return forward
