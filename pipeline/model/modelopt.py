"""The one reader of ModelOpt-exported checkpoints: quantization info (`quant_algo`), the packed weights and
scales of each quantized linear, their dequantization, and, for dgpipe's runtime, faithful activation
fake-quantization hooked onto the linears of activation-quantized formats. `pipeline.model.checkpoint`
(dequantize on load) and `pipeline.onnx` (Q/DQ export of the packed tensors) both read through it.

Layouts, as `modelopt.torch.export.export_hf_checkpoint` (0.47) writes them per quantized linear:
* FP8:      weight float8_e4m3fn [out, in]; weight_scale fp32 (per tensor); input_scale fp32.
* NVFP4:    weight uint8 [out, in/2], two E2M1 codes per byte, low nibble = even column; weight_scale
            float8_e4m3fn [out, in/16]; weight_scale_2 fp32; input_scale fp32 (= amax / (6 * 448)).
* W4A16_AWQ: weight uint8 [out/2, in], two signed int4 per byte along the OUTPUT dim, low nibble = even
            row; weight_scale [out, in/group] (fp32 as ModelOpt writes it, bf16 after `dgpipe quantize`'s
            finalize; both read); optional pre_quant_scale [in] multiplies the input.
Fused-expert models are exported one 2-D tensor per expert and projection (`experts.E.gate_proj`), which
`pipeline.model.checkpoint` fuses back after dequantization.

Not emulated: an FP8 KV cache (`--kv-cache fp8` exports `k_proj.k_scale` / `v_proj.v_scale` for vLLM and
TensorRT-LLM); dgpipe's CPU runtime reads past them and keeps K/V in the compute dtype.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pipeline.errors import CheckpointError
from pipeline.model.fake_quant import ACTIVATION_FORMATS, E2M1_VALUES, InputQuantizer
from pipeline.model.files import read_json_object, runtime_name, weight_files
from pipeline.model.network import gelu_tanh
from pipeline.targets import Precision, precision_for_quant_algo, supported_quant_algos

LINEAR_AUX = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")  # beside `<linear>.weight`
AUX_SUFFIXES = (*LINEAR_AUX, "k_scale", "v_scale")
EXPERT = re.compile(r"^(layers\.\d+\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$")


def quantization_info(path: Path) -> dict[str, Any] | None:
    """hf_quant_config.json's `quantization` block, else config.json's `quantization_config` when ModelOpt
    wrote it (`quant_method: modelopt`, or no quant_method but a `quant_algo`); None when the checkpoint is
    not ModelOpt-quantized."""
    hq = path / "hf_quant_config.json"
    if hq.is_file():
        block = read_json_object(hq).get("quantization")
        if not isinstance(block, dict):
            raise CheckpointError(f"{hq}: 'quantization' is not an object", "the file is damaged")
        if block.get("quant_algo") is None and block.get("kv_cache_quant_algo"):
            raise CheckpointError(
                f"{hq}: quantizes only the KV cache ({block['kv_cache_quant_algo']}), which dgpipe does not run",
                "pass the unquantized checkpoint, or one with quantized weights",
            )
        return block
    cfg = path / "config.json"
    if cfg.is_file():
        q = read_json_object(cfg).get("quantization_config")
        if not isinstance(q, dict):
            return None
        method = q.get("quant_method")
        if method == "modelopt" or (method is None and "quant_algo" in q):
            return q
    return None


def quant_algo(path: Path) -> str | None:
    """The checkpoint's ModelOpt `quant_algo` ("FP8", "NVFP4", "W4A16_AWQ", ...), None when unquantized."""
    info = quantization_info(path)
    algo = info.get("quant_algo") if info else None
    return str(algo) if algo else None


def precision_of(algo: str) -> Precision:
    """The dgpipe precision of a ModelOpt `quant_algo`, or a CheckpointError naming the ones it runs."""
    p = precision_for_quant_algo(algo)
    if p is None:
        raise CheckpointError(
            f"quant_algo {algo!r} is not supported by dgpipe's runtime",
            f"supported: {', '.join(supported_quant_algos())}",
        )
    return p


@cache
def packed_format(algo: str) -> str:
    """How a uint8 weight of this quant_algo is packed: the precision's name ('nvfp4', 'int4_awq')."""
    return precision_of(algo).name


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mag = E2M1_VALUES.to(packed.device)[codes & 0x7]
    return torch.where(codes >= 8, -mag, mag)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[out/2, in] uint8 -> [out, in] int values in [-8, 7] (low nibble = even output row)."""
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    q = torch.stack([lo, hi], dim=1).reshape(packed.shape[0] * 2, packed.shape[1])
    return torch.where(q >= 8, q - 16, q)


def is_packed(t: torch.Tensor) -> bool:
    """A quantized weight as ModelOpt stores it (FP8 E4M3, or two 4-bit codes per byte)."""
    return t.dtype in (torch.float8_e4m3fn, torch.uint8)


def dequantize_weight(algo: str, w: torch.Tensor, get: Callable[[str], torch.Tensor | None]) -> torch.Tensor:
    """One exported weight -> fp32 [out, in]; `get(suffix)` fetches a sibling tensor (or None). Scales are
    combined in ModelOpt's order (NVFP4: block scale x global scale first), which is also what the ONNX
    DequantizeLinear chain computes."""
    if w.dtype == torch.float8_e4m3fn:
        scale = get("weight_scale")
        s = scale.float() if scale is not None else torch.tensor(1.0)
        return w.float() * (s.reshape(-1, 1) if s.dim() >= 1 and s.numel() == w.shape[0] else s)
    if w.dtype != torch.uint8:
        return w
    fmt = packed_format(algo)
    if fmt == "nvfp4":
        block_scale, global_scale = get("weight_scale"), get("weight_scale_2")
        if block_scale is None or global_scale is None:
            raise CheckpointError("NVFP4 weight without weight_scale / weight_scale_2")
        vals = unpack_e2m1(w)
        block = vals.shape[-1] // block_scale.shape[-1]
        return vals * (block_scale.float() * global_scale.float()).repeat_interleave(block, -1)
    if fmt == "int4_awq":
        scale = get("weight_scale")
        if scale is None:
            raise CheckpointError("INT4 weight without weight_scale")
        q = unpack_int4_rows(w).float()
        group = q.shape[-1] // scale.shape[-1]
        return q * scale.float().repeat_interleave(group, -1)
    raise CheckpointError(f"packed uint8 weight for unsupported quant_algo {algo!r}")


@dataclass
class PackedLinear:
    """One quantized linear as the checkpoint stores it (layouts in the module docstring). Per-tensor
    scales are fp32; `weight_scale` keeps its stored dtype (E4M3 block scales for NVFP4)."""

    algo: str
    weight: torch.Tensor
    weight_scale: torch.Tensor | None = None
    weight_scale_2: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("weight_scale_2", "input_scale"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).float())
        if self.weight.dtype == torch.float8_e4m3fn and self.weight_scale is not None:
            self.weight_scale = self.weight_scale.float()

    @property
    def format(self) -> str:
        """'fp8', 'nvfp4' or 'int4_awq' (the precision this tensor is stored in)."""
        return "fp8" if self.weight.dtype == torch.float8_e4m3fn else packed_format(self.algo)

    def dequantized(self) -> torch.Tensor:
        return dequantize_weight(self.algo, self.weight, lambda suffix: getattr(self, suffix))

    def to(self, device: torch.device) -> PackedLinear:
        """The same packed tensors on `device` (the GPU then does the layout conversions)."""
        moved = {n: getattr(self, n) for n in ("weight", *LINEAR_AUX) if getattr(self, n) is not None}
        return replace(self, **{n: t.to(device) for n, t in moved.items()})


def read_packed_linears(path: Path) -> dict[str, PackedLinear]:
    """Every quantized linear of a ModelOpt checkpoint, packed as stored, keyed by runtime module path
    ("layers.0.self_attn.q_proj", "layers.0.experts.3.gate_proj", ...). Tensors the runtime does not read
    (the vision tower, the encoder's tied copies) are skipped, as `load_model` skips them."""
    info = quantization_info(path)
    if info is None:
        raise CheckpointError(
            f"{path}: not a ModelOpt-quantized checkpoint",
            "expected hf_quant_config.json or a quantization_config in config.json",
        )
    algo = str(info.get("quant_algo"))
    precision_of(algo)
    files = weight_files(path)
    handles: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        f = files[name]
        if f not in handles:
            handles[f] = safe_open(f, "pt")
        return handles[f].get_tensor(name)

    out: dict[str, PackedLinear] = {}
    for name in files:
        target = runtime_name(name)
        if target is None or not name.endswith(".weight"):
            continue
        w = read(name)
        if not is_packed(w):
            continue
        base = name.removesuffix("weight")
        aux = {s: read(base + s) for s in LINEAR_AUX if base + s in files}
        out[target.removesuffix(".weight")] = PackedLinear(algo, w, **aux)
    return out


class QuantizedLoader:
    """What `pipeline.model.checkpoint.load_model` asks of a quantized checkpoint."""

    def __init__(self, info: dict[str, Any]):
        self.algo = str(info.get("quant_algo"))
        p = precision_of(self.algo)
        self.act = p.activations if p.activations in ACTIVATION_FORMATS else None  # None: weight-only
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
        q = PackedLinear(self.algo, t, **{suffix: fetch(suffix) for suffix in LINEAR_AUX})
        if q.input_scale is not None:
            self.input_scales[module] = q.input_scale
        if q.pre_quant_scale is not None:
            if EXPERT.match(module):  # `install` would have nowhere to apply it: outputs silently wrong
                raise CheckpointError(
                    f"{module}: an AWQ pre_quant_scale on a routed expert, which dgpipe does not apply",
                    "re-quantize with `dgpipe quantize --precision int4_awq` (round-to-nearest, no smoothing scales)",
                )
            self.pre_quant_scales[module] = q.pre_quant_scale.float()
        return q.dequantized()

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
            # the scales as read (on the CPU), put where the linear's input will be: a [K] pre_quant_scale
            # on the CPU cannot multiply a CUDA activation
            dev, scale, pre = (
                module.weight.device,
                self.input_scales.get(name),
                self.pre_quant_scales.get(name),
            )
            q = InputQuantizer(
                self.act, None if scale is None else scale.to(dev), None if pre is None else pre.to(dev)
            )
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

    forward.graph_safe = False  # `.tolist()` of the routing counts: a host sync per layer
    forward.input_quantizers = quants  # for a runtime that computes the same on the device (runtime.routed)
    return forward
