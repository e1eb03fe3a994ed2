"""The shapes a config implies, and the check of a checkpoint's tensor headers against them: every tensor's
name, dtype and shape before a byte of weights is read or allocated (`validate_checkpoint` and `load_model`
both run it)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import CheckpointError
from pipeline.model.config import ModelConfig
from pipeline.model.files import (
    DECODER,
    FIX_DIR,
    FLOAT_DTYPES,
    PACKED_DTYPES,
    PER_EXPERT,
    SCALE_DTYPES,
    SKIPPED_PREFIXES,
    TensorHeader,
    runtime_name,
)
from pipeline.model.modelopt import AUX_SUFFIXES, packed_format
from pipeline.model.network import DiffusionGemma


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Runtime parameter name -> shape, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def packed_shape(fmt: str, out_dim: int, in_dim: int) -> tuple[int, int]:
    """The stored shape of a packed [out, in] weight (pipeline.model.modelopt documents the layouts)."""
    if fmt == "nvfp4":
        return (out_dim, in_dim // 2)
    if fmt == "int4_awq":
        return (out_dim // 2, in_dim)
    return (out_dim, in_dim)


def check_tensors(
    config: ModelConfig, headers: dict[str, TensorHeader], quant_algo: str | None, where: Path
) -> None:
    """Every tensor's name, dtype and shape against what the config implies; none missing, none extra."""
    fmt = packed_format(quant_algo) if quant_algo else None
    expected = expected_shapes(config)
    hint = "the weights do not belong to this config.json: " + FIX_DIR
    seen: set[str] = set()
    experts: dict[str, set[tuple[int, str]]] = {}
    for name, h in headers.items():
        target = runtime_name(name)
        if target is None:
            if not name.startswith(SKIPPED_PREFIXES):
                raise CheckpointError(
                    f"{h.file}: unexpected tensor '{name}'", "is this a DiffusionGemma checkpoint?"
                )
            continue
        suffix = name.rsplit(".", 1)[-1]
        if fmt is not None and suffix in AUX_SUFFIXES:  # scales: checked when dequantized
            if h.dtype not in SCALE_DTYPES:
                raise CheckpointError(f"{h.file}: scale '{name}' has dtype {h.dtype}", hint)
            continue
        m = PER_EXPERT.search(target)
        if m:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            fused = expected.get(f"{prefix}.gate_up_proj")
            if fused is None or e >= fused[0]:
                raise CheckpointError(f"{h.file}: unexpected tensor '{name}'", hint)
            inner, hidden = fused[1] // 2, fused[2]
            want = (hidden, inner) if proj == "down_proj" else (inner, hidden)
            experts.setdefault(prefix, set()).add((e, proj))
        elif target in expected:
            want = expected[target]
            seen.add(target)
        else:
            raise CheckpointError(
                f"{h.file}: unexpected tensor '{name}'", "is this a DiffusionGemma checkpoint?"
            )
        if h.dtype in PACKED_DTYPES and fmt is not None and len(want) == 2:
            want = packed_shape(fmt if h.dtype == "U8" else "fp8", *want)
        elif h.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{h.file}: tensor '{name}' has dtype {h.dtype}",
                f"weights are {', '.join(FLOAT_DTYPES)}"
                + (" (or ModelOpt-packed)" if fmt else "")
                + ": "
                + FIX_DIR,
            )
        if h.shape != want:
            raise CheckpointError(
                f"{h.file}: tensor '{name}' has shape {h.shape}, config.json implies {want}", hint
            )
    for prefix, got in experts.items():
        seen.update((f"{prefix}.gate_up_proj", f"{prefix}.down_proj"))
        n = expected[f"{prefix}.gate_up_proj"][0]
        lacking = sorted({(e, p) for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")} - got)
        if lacking:
            e, p = lacking[0]
            raise CheckpointError(f"{where}: tensor '{DECODER}{prefix}.{e}.{p}.weight' is missing", hint)
    for name in expected:
        if name not in seen and not name.endswith("encoder_layer_scalar"):
            raise CheckpointError(f"{where}: tensor '{DECODER}{name}' is missing from the weights", hint)
