"""ModelOpt quantization config from a dgpipe recipe (configs/precisions/*.yaml) plus CLI overrides.

ModelOpt's stock configs (`mtq.NVFP4_DEFAULT_CFG`, ...) are ordered lists of quantizer-name rules where a
later rule wins; we append our own disable rules (the recipe's `keep_high_precision`, `--exclude`) and the
KV-cache rules, so the stock defaults (routers, lm_head, vision tower off) stay in force underneath.
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Any

from torch import nn

from pipeline.errors import DgpipeError
from pipeline.targets import Precision

KV_CACHE_CHOICES = ("none", "fp8")


def quantizer_pattern(module_pattern: str) -> str:
    """A module-name glob (`*self_conditioning*`, `model.decoder.layers.0.mlp`) -> a glob over the names of
    that module's quantizers (`...mlp.weight_quantizer`, `...experts.gate_up_proj_weight_quantizers.3`)."""
    return module_pattern if module_pattern.endswith("*") else module_pattern + "*"


def tied_patterns(patterns: list[str]) -> list[str]:
    """`--exclude model.decoder.layers.0.*` must also reach the tied encoder copy of those linears
    (`model.encoder.language_model.layers.0.*`): one weight serves both modes, so both stay unquantized."""
    out: list[str] = []
    for pat in patterns:
        out.append(pat)
        if "model.decoder." in pat:
            out.append(pat.replace("model.decoder.", "model.encoder.language_model."))
    return out


def quantized_input_dims(model: nn.Module, p: Precision, exclude: list[str]) -> set[int]:
    """Input dims of every linear (and fused expert projection) the recipe quantizes."""
    keep = [*p.keep_high_precision, *exclude]
    dims: set[int] = set()
    for name, mod in model.named_modules():
        if any(fnmatch.fnmatch(name, k) for k in keep) or "vision" in name:
            continue
        if isinstance(mod, nn.Linear) and any(fnmatch.fnmatch(name, q) for q in p.quantize):
            dims.add(mod.in_features)
        elif hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and name.endswith("experts"):
            dims.update({int(mod.gate_up_proj.shape[-1]), int(mod.down_proj.shape[-1])})
    return dims


def choose_block_size(p: Precision, dims: set[int]) -> int:
    """The recipe's block size, or the first fallback that divides every quantized input dim."""
    for b in [p.block_size, *p.fallback_block_sizes]:
        if b and all(d % b == 0 for d in dims):
            return b
    raise DgpipeError(
        f"--precision {p.name}: no block size in {[p.block_size, *p.fallback_block_sizes]} divides the "
        f"quantized layers' input dims {sorted(dims)}",
        "exclude the odd-sized layers with --exclude or pick another precision",
    )


def build_mtq_config(
    p: Precision,
    exclude: list[str] | None = None,
    kv_cache: str = "none",
    block_size: int | None = None,
    algorithm: str | dict | None = None,
) -> dict[str, Any]:
    """The dict passed to `mtq.quantize`. bf16 has no ModelOpt config (it is a plain cast).
    `algorithm` overrides the stock calibration algorithm (the recipe's `modelopt_algorithm`)."""
    import modelopt.torch.quantization as mtq

    if p.modelopt_config is None:
        raise DgpipeError(f"precision {p.name} is not quantized; it needs no ModelOpt config")
    if kv_cache not in KV_CACHE_CHOICES:
        raise DgpipeError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHE_CHOICES)}")
    base = getattr(mtq, p.modelopt_config, None)
    if base is None:
        raise DgpipeError(
            f"configs/precisions/{p.name}.yaml names modelopt_config {p.modelopt_config}, which this "
            "nvidia-modelopt does not have",
            "upgrade nvidia-modelopt (pip install -e '.[quantize]')",
        )
    cfg = copy.deepcopy(base)
    rules: list[dict[str, Any]] = cfg["quant_cfg"]
    if p.block_size:  # the recipe's block size (or the fallback chosen for this model) overrides ModelOpt's
        for r in rules:
            bs = r["cfg"].get("block_sizes") if isinstance(r.get("cfg"), dict) else None
            if bs and -1 in bs:
                bs[-1] = block_size or p.block_size
    for pat in [*p.keep_high_precision, *tied_patterns(exclude or [])]:
        rules.append({"quantizer_name": quantizer_pattern(pat), "enable": False})
    algorithm = algorithm if algorithm is not None else p.modelopt_algorithm
    if algorithm is not None:
        cfg["algorithm"] = algorithm
    if kv_cache == "fp8":
        rules.extend(copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    return cfg
