"""LoRA adapters of every producer, read and merged into a Hugging Face DiffusionGemma state dict.

Why dgpipe merges itself instead of `PeftModel.merge_and_unload()`: DiffusionGemma's transformers model has
two module trees (encoder for prefill/commit, decoder for denoise) over ONE tied set of weights, and
NeMo AutoModel's native model has a single stack under `model.layers` (no `.decoder.`), which PEFT cannot
map onto the transformers model at all. So each producer's key layout is normalised to the checkpoint's
tensor name (`model.decoder.layers.N.<module>.weight`), and the delta is added once per tied weight with
the producer's own formula:

* PEFT / Unsloth (peft/tuners/lora/layer.py `get_delta_weight`): W += s * B @ A, s = alpha / r, or
  alpha / sqrt(r) with `use_rslora`; `lora_embedding_A/B` on an embedding: W += s * (B @ A).T.
* NeMo AutoModel (nemo_automodel/components/_peft/lora.py `LinearLoRA`): W += (alpha / dim) * B @ A;
  adapter_config.json carries r = dim and lora_alpha = alpha.

An adapter with different deltas for the tied encoder and decoder copies cannot be represented by one set of
weights (dgpipe's runtime, vLLM and TensorRT all run one) and is refused, as are variants whose merge is not
this sum (DoRA, modules_to_save, bias training, other PEFT types), each naming the adapter_config field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import DgpipeError

_KEY = re.compile(
    r"^base_model\.model\.(.+?)\.lora_(A|B|embedding_A|embedding_B)(?:\.default)?(?:\.weight)?$"
)
_ENCODER = re.compile(r"^model\.encoder\.language_model\.(layers\.\d+\..+|embed_tokens)$")
_DECODER = re.compile(r"^model\.decoder\.(.+)$")
_AUTOMODEL = re.compile(r"^model\.((?:layers\.\d+\.|embed_tokens|norm|self_conditioning).*)$")
TIED_HEAD = "lm_head"


@dataclass
class Adapter:
    """A LoRA adapter in one layout: per checkpoint tensor name, its (A, B, is_embedding) pairs."""

    path: Path
    base: str | None
    scaling: float
    fan_in_fan_out: bool
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor, bool]]]


def _refuse(adapter: Path, field: str, value: Any, why: str) -> DgpipeError:
    return DgpipeError(
        f"--adapter {adapter}: adapter_config.json {field}={value!r} is not supported ({why})",
        "merge it with the tool that trained it and pass the merged checkpoint as --model",
    )


def scaling(cfg: dict[str, Any], adapter: Path) -> float:
    """The producer's scale: alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's LoraLayer.update_layer)."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise DgpipeError(f"--adapter {adapter}: adapter_config.json needs an integer r >= 1 and lora_alpha")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise _refuse(
            adapter,
            "rank_pattern/alpha_pattern",
            cfg.get("rank_pattern") or cfg.get("alpha_pattern"),
            "per-module ranks",
        )
    return alpha / (r**0.5 if cfg.get("use_rslora") else r)


def _check_config(cfg: dict[str, Any], adapter: Path) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(adapter, "peft_type", cfg.get("peft_type"), "only LoRA merges into the weights")
    if cfg.get("use_dora"):
        raise _refuse(adapter, "use_dora", True, "DoRA rescales each weight row by a learned magnitude")
    if cfg.get("modules_to_save"):
        raise _refuse(adapter, "modules_to_save", cfg["modules_to_save"], "full module copies, not LoRA")
    if cfg.get("bias", "none") != "none":
        raise _refuse(adapter, "bias", cfg["bias"], "trained biases; DiffusionGemma's linears have none")
    for flag in ("use_qalora", "lora_bias"):
        if cfg.get(flag):
            raise _refuse(adapter, flag, cfg[flag], "a variant whose merge is not W + s * B @ A")
    if cfg.get("target_parameters"):
        raise _refuse(adapter, "target_parameters", cfg["target_parameters"], "LoRA on the MoE experts")


def checkpoint_name(module: str, adapter: Path) -> str:
    """The checkpoint tensor a LoRA module adapts, in every producer's layout: transformers' decoder
    (`model.decoder.layers.N.x`), its tied encoder copy (`model.encoder.language_model.layers.N.x`) and
    AutoModel's single stack (`model.layers.N.x`) all name `model.decoder.layers.N.x.weight`; a tied
    `lm_head` names the embedding."""
    for pattern in (_DECODER, _ENCODER, _AUTOMODEL):
        m = pattern.match(module)
        if m:
            return f"model.decoder.{m.group(1)}.weight"
    if module == TIED_HEAD:
        raise DgpipeError(
            f"--adapter {adapter}: a LoRA on lm_head, which DiffusionGemma ties to the input embedding",
            "merging it would change the embedding too; train with embed_tokens instead of lm_head",
        )
    raise DgpipeError(
        f"--adapter {adapter}: targets '{module}', which is not a DiffusionGemma text module",
        "the adapter belongs to another architecture (or to the vision tower)",
    )


def read_adapter(adapter: Path) -> Adapter:
    """adapter_config.json (checked) and adapter_model.safetensors, keys normalised per producer layout."""
    from safetensors.torch import load_file

    cfg_file, wfile = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise DgpipeError(f"--adapter {adapter}: no adapter_config.json", "pass a LoRA adapter directory")
    if not wfile.is_file():
        raise DgpipeError(f"--adapter {adapter}: no adapter_model.safetensors (pickled adapters are refused)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DgpipeError(f"--adapter {adapter}: adapter_config.json is not JSON ({e})") from e
    _check_config(cfg, adapter)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(wfile)).items():
        m = _KEY.match(key)
        if not m:
            raise DgpipeError(f"--adapter {adapter}: unexpected tensor '{key}' (not a LoRA A/B weight)")
        halves.setdefault(m.group(1), {})[m.group(2)] = t
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}
    for module, ab in sorted(halves.items()):
        emb = "embedding_A" in ab or "embedding_B" in ab
        a, b = (ab.get("embedding_A"), ab.get("embedding_B")) if emb else (ab.get("A"), ab.get("B"))
        if a is None or b is None:
            raise DgpipeError(f"--adapter {adapter}: '{module}' lacks lora_A or lora_B")
        pairs.setdefault(checkpoint_name(module, adapter), []).append((a, b, emb))
    return Adapter(
        adapter,
        cfg.get("base_model_name_or_path"),
        scaling(cfg, adapter),
        bool(cfg.get("fan_in_fan_out")),
        pairs,
    )


def delta(a: torch.Tensor, b: torch.Tensor, s: float, embedding: bool, fan_in_fan_out: bool) -> torch.Tensor:
    """PEFT's get_delta_weight in fp32: s * B @ A ((B @ A).T for an embedding, transposed for Conv1D-style)."""
    d = s * (b.float() @ a.float())
    return d.T if embedding or fan_in_fan_out else d


@torch.no_grad()
def merge_into(state: dict[str, torch.Tensor], ad: Adapter) -> list[str]:
    """Add every delta to `state` in place (fp32 sum, cast back to the weight's dtype), once per tied
    weight; returns the merged tensor names."""
    for name, ab in ad.pairs.items():
        if name not in state:
            raise DgpipeError(
                f"--adapter {ad.path}: adapts '{name}', which the base checkpoint does not have",
                "the adapter belongs to another architecture or base model",
            )
        deltas = [delta(a, b, ad.scaling, emb, ad.fan_in_fan_out) for a, b, emb in ab]
        for d in deltas:
            if tuple(d.shape) != tuple(state[name].shape):
                raise DgpipeError(
                    f"--adapter {ad.path}: '{name}' delta has shape {tuple(d.shape)}, the base weight "
                    f"{tuple(state[name].shape)}",
                    "the adapter was trained on a base model of another size",
                )
            if not torch.allclose(d, deltas[0], atol=1e-6, rtol=1e-4):
                raise DgpipeError(
                    f"--adapter {ad.path}: different LoRA deltas for the tied encoder and decoder copies of "
                    f"'{name}'",
                    "the model runs one set of weights in both modes; train the adapter with tied encoder/decoder",
                )
        w = state[name]
        state[name] = (w.float() + deltas[0]).to(w.dtype)
    return sorted(ad.pairs)


def same_base(declared: str | None, base: Path) -> bool:
    """The adapter's base_model_name_or_path names this checkpoint (path, or same final name component,
    e.g. `google/diffusiongemma-26B-A4B-it` vs a local `.../diffusiongemma-26B-A4B-it`)."""
    if not declared or declared == "N/A":
        return True  # not recorded: names and shapes still have to match
    d = declared.rstrip("/")
    if Path(d).exists() and Path(d).resolve() == base.resolve():
        return True
    return d.split("/")[-1].lower() == base.resolve().name.lower()
