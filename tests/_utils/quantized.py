"""A ModelOpt-layout FP8 or NVFP4 checkpoint of the embedded model, made with dgpipe's own quantizers
(`pipeline.model.scaled_layout`), for the tests of the quantized runtime paths: tests/gpu run them on GPU
hosts that have no ModelOpt, and fixed input scales keep the runtime tests' bounds independent of a
calibration. tests/unit/quantize/test_quantize.py holds it to ModelOpt's own export of the same model (every
tensor's name, dtype and shape, the quantizer named in both configs); tests that read a checkpoint's format
itself (the ONNX export's) read ModelOpt's export. Every linear ModelOpt
quantizes (attention, dense MLP, experts per expert) gets its weight quantized from the float weight and a
fixed input scale; the rest stays as stored. NVFP4 siblings that read one input (q, k, v; gate, up) share one
global scale, the largest of theirs, as ModelOpt's export makes it (`preprocess_linear_fusion` in
modelopt/torch/export/quant_utils.py unifies the NVFP4 global amax of fused linears; FP8 weight scales
stay one per linear, as a real export of the embedded model shows)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.model import scaled_layout as sl
from pipeline.model.checkpoint import hf_state_dict, load_model
from pipeline.model.fake_quant import E4M3_MAX
from pipeline.model.files import DECODER
from pipeline.model.modelopt import PackedLinear
from pipeline.resources import EMBEDDED_MODEL

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
INPUT_AMAX = 8.0  # activation amax the fixed input scales stand for
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings reading one input


def quantize(w: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One float weight [out, in] -> its ModelOpt tensors (weight, scales, input scale). `amax`: NVFP4's
    global amax where siblings share it (default: this weight's own)."""
    if fmt == "fp8":
        ws = w.abs().max() / E4M3_MAX
        return {"weight": sl.fp8_quantize(w, ws), "weight_scale": ws.reshape(()),
                "input_scale": torch.tensor(INPUT_AMAX / E4M3_MAX)}  # fmt: skip
    gs = (w.abs().max() if amax is None else amax) / (6 * E4M3_MAX)
    packed, bs = sl.nvfp4_quantize(w, gs)
    return {"weight": packed, "weight_scale": bs, "weight_scale_2": gs.reshape(()),
            "input_scale": torch.tensor(INPUT_AMAX / (6 * E4M3_MAX))}  # fmt: skip


def packed_linear(fmt: str, n: int, k: int, gen: torch.Generator) -> PackedLinear:
    """A random linear [n, k] (weights ~ N(0, 0.1)) quantized to `fmt` as ModelOpt stores it."""
    return PackedLinear(fmt.upper(), **quantize(torch.randn(n, k, generator=gen) * 0.1, fmt))


def grouped_scaled_mm_on_cpu(out_dtype: torch.dtype = torch.float32):
    """A stand-in for `F.scaled_grouped_mm` (RowWise, 2-D rows x 3-D experts; CUDA-only): one CPU
    `F.scaled_mm` per group, in fp32, cast to `out_dtype` (bf16: what the GPU kernel writes; tests/gpu
    checks that kernel against the same references)."""
    F = torch.nn.functional

    def grouped(a, b, scale_a, recipe_a, scale_b, recipe_b, offs=None, output_dtype=None, **_):
        out, start = [], 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                out.append(F.scaled_mm(a[start:end], b[g], scale_a[start:end, None], F.ScalingType.RowWise,
                                       scale_b[g][None], F.ScalingType.RowWise, output_dtype=torch.float32))  # fmt: skip
            start = end
        return torch.cat(out).to(out_dtype)

    return grouped


def build_quantized_checkpoint(out: Path, fmt: str, src: Path = EMBEDDED_MODEL) -> Path:
    model = load_model(src)[0]
    state = hf_state_dict(model)
    for i, layer in enumerate(model.layers):
        present = [n for n in LINEARS if not (n == "self_attn.v_proj" and layer.self_attn.v_proj is None)]
        weights = {n: model.get_submodule(f"layers.{i}.{n}").weight.detach().float() for n in present}
        groups = [[n for n in present if n.split(".")[-1] in names] for names in SHARED_INPUT]
        amax = {n: max(weights[s].abs().max() for s in group) for group in groups for n in group}
        for name in present:
            path = f"layers.{i}.{name}"
            del state[f"{DECODER}{path}.weight"]
            q = quantize(weights[name], fmt, amax.get(name))
            state.update({f"{DECODER}{path}.{k}": v for k, v in q.items()})
        ex = layer.experts
        del (
            state[f"{DECODER}layers.{i}.experts.gate_up_proj"],
            state[f"{DECODER}layers.{i}.experts.down_proj"],
        )
        inner = ex.gate_up_proj.shape[1] // 2
        for e in range(ex.num_experts):
            gu = ex.gate_up_proj[e].detach().float()
            for proj, w in (
                ("gate_proj", gu[:inner]),
                ("up_proj", gu[inner:]),
                ("down_proj", ex.down_proj[e].detach().float()),
            ):
                q = quantize(w, fmt)
                if fmt == "nvfp4" and proj != "down_proj":  # ModelOpt's fused gate/up global scale
                    gs = gu.abs().max() / (6 * E4M3_MAX)
                    q["weight"], q["weight_scale"] = sl.nvfp4_quantize(w, gs)
                    q["weight_scale_2"] = gs.reshape(())
                state.update({f"{DECODER}layers.{i}.experts.{e}.{proj}.{k}": v for k, v in q.items()})
    algo = {"fp8": "FP8", "nvfp4": "NVFP4"}[fmt]
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo}
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": algo}}))
    for name in ("generation_config.json", "dgpipe.json", "tokenizer.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    return out


def modelopt_checkpoint(out: Path, precision: str) -> Path:
    """ModelOpt's own export of the embedded model (the quantize stage: calibration, then ModelOpt's HF export;
    unquantized tensors in float32), ~9 s: the real producer's files, not an imitation of them."""
    from quantize.run import QuantizeOptions, quantize_checkpoint

    opts = QuantizeOptions(
        EMBEDDED_MODEL, precision, out, calib_size=8, calib_steps=4, export_dtype="float32"
    )
    return Path(quantize_checkpoint(opts).output)
