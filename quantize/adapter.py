"""Merge a PEFT LoRA adapter into a DiffusionGemma checkpoint before quantization.

Why not `PeftModel.from_pretrained(...).merge_and_unload()` alone: DiffusionGemma's transformers model has
two module trees (encoder for prefill/commit, decoder for denoise) over ONE tied set of weights. A LoRA
trained on it has separate A/B for `model.encoder.language_model.layers.N.*` and `model.decoder.layers.N.*`,
and PEFT's merge adds both deltas into the shared tensor (W + dE + dD), which neither mode was trained
with. So: PEFT parses and validates the adapter config, and the merge is done here, once per tied weight;
an adapter whose encoder and decoder deltas differ cannot be represented by one set of weights (dgpipe's
runtime, vLLM and TensorRT all run one) and is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import DgpipeError

ENC = re.compile(r"^model\.encoder\.language_model\.layers\.(\d+)\.(.+)$")
KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight$")


def _same_base(declared: str | None, base: Path) -> bool:
    """The adapter's base_model_name_or_path names this checkpoint (path, or same final name component,
    e.g. `google/diffusiongemma-26B-A4B-it` vs a local `.../diffusiongemma-26B-A4B-it`)."""
    if not declared:
        return True  # not recorded: shapes and module names below still have to match
    d = declared.rstrip("/")
    if Path(d).exists() and Path(d).resolve() == base.resolve():
        return True
    return d.split("/")[-1].lower() == base.resolve().name.lower()


def _decoder_name(module: str) -> str:
    m = ENC.match(module)
    return f"model.decoder.layers.{m.group(1)}.{m.group(2)}" if m else module


def load_lora(adapter: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    from peft import LoraConfig
    from safetensors.torch import load_file

    cfg_file = adapter / "adapter_config.json"
    if not cfg_file.is_file():
        raise DgpipeError(f"--adapter {adapter}: no adapter_config.json", "pass a PEFT adapter directory")
    raw = json.loads(cfg_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise DgpipeError(f"--adapter {adapter}: peft_type {raw.get('peft_type')!r}; only LoRA merges")
    cfg = LoraConfig.from_pretrained(str(adapter))
    if getattr(cfg, "use_dora", False) or cfg.modules_to_save:
        raise DgpipeError(f"--adapter {adapter}: DoRA and modules_to_save are not supported for merging")
    wfile = adapter / "adapter_model.safetensors"
    if not wfile.is_file():
        raise DgpipeError(f"--adapter {adapter}: no adapter_model.safetensors (pickled adapters are refused)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in load_file(str(wfile)).items():
        m = KEY.match(k)
        if not m:
            raise DgpipeError(f"--adapter {adapter}: unexpected tensor '{k}' (not a LoRA A/B weight)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    scaling = cfg.lora_alpha / (cfg.r**0.5 if cfg.use_rslora else cfg.r)
    return {
        "base": raw.get("base_model_name_or_path"),
        "scaling": scaling,
        "fan_in_fan_out": cfg.fan_in_fan_out,
    }, pairs


@torch.no_grad()
def merge_adapter(model: nn.Module, base: Path, adapter: Path) -> nn.Module:
    """W += scaling * B @ A for every adapted linear, once per tied weight; refuses a foreign adapter."""
    meta, pairs = load_lora(adapter)
    if not _same_base(meta["base"], base):
        raise DgpipeError(
            f"--adapter {adapter} was trained on '{meta['base']}', not on {base}",
            "merge an adapter into the base model it was trained from",
        )
    deltas: dict[str, torch.Tensor] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise DgpipeError(f"--adapter {adapter}: '{module}' lacks lora_A or lora_B")
        try:
            target = model.get_submodule(module)
        except AttributeError as e:
            raise DgpipeError(
                f"--adapter {adapter}: targets '{module}', which this model does not have",
                "the adapter belongs to another architecture or base model",
            ) from e
        if not isinstance(target, nn.Linear):
            raise DgpipeError(f"--adapter {adapter}: '{module}' is a {type(target).__name__}, not a Linear")
        a, b = ab["A"].float(), ab["B"].float()
        delta = meta["scaling"] * (b @ a)
        if meta["fan_in_fan_out"]:
            delta = delta.T
        if tuple(delta.shape) != tuple(target.weight.shape):
            raise DgpipeError(
                f"--adapter {adapter}: '{module}' delta has shape {tuple(delta.shape)}, the model's weight "
                f"{tuple(target.weight.shape)}",
                "the adapter was trained on a base model of another size",
            )
        key = _decoder_name(module)  # encoder and decoder module of one tied weight share a key
        if key in deltas and not torch.allclose(deltas[key], delta, atol=1e-6, rtol=1e-4):
            raise DgpipeError(
                f"--adapter {adapter}: different LoRA deltas for the tied encoder and decoder copies of '{key}'",
                "the model runs one set of weights in both modes; train the adapter with tied encoder/decoder",
            )
        deltas[key] = delta
    for key, delta in deltas.items():
        w = model.get_submodule(key).weight
        w.add_(delta.to(w.dtype))
    return model
