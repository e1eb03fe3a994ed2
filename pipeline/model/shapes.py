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


SCALAR = ((), (1,))


def check_scales(
    base: str, fmt: str, out_in: tuple[int, ...], headers: dict[str, TensorHeader], file: Path
) -> None:
    """A packed linear's scales as ModelOpt writes them (pipeline.model.modelopt's layouts), named when one is
    missing or of another shape: without this a missing FP8 weight_scale read the raw E4M3 codes as weights,
    and a [1, in/16] block scale was broadcast over every row."""
    out_f, in_f = out_in
    wanted: dict[str, tuple[tuple[int, ...], ...]] = {"input_scale": SCALAR}  # every format here quantizes x
    if fmt == "fp8":
        wanted["weight_scale"] = (*SCALAR, (out_f,), (out_f, 1))
    elif fmt == "nvfp4":
        wanted |= {"weight_scale": ((out_f, in_f // 16),), "weight_scale_2": SCALAR}
    else:  # int4_awq: weight-only, groups of the input dimension
        scale = headers.get(base + "weight_scale")
        groups = scale.shape[-1] if scale is not None and len(scale.shape) == 2 else 0
        ok = groups > 0 and in_f % groups == 0
        wanted = {"weight_scale": ((out_f, groups),) if ok else ((out_f, -1),)}
    for suffix, shapes in wanted.items():
        h = headers.get(base + suffix)
        if h is None:
            raise CheckpointError(
                f"{file}: {fmt.upper()} weight '{base}weight' has no '{suffix}'",
                "the checkpoint is incomplete: " + FIX_DIR,
            )
        if h.shape not in shapes:
            raise CheckpointError(
                f"{file}: '{base}{suffix}' has shape {h.shape}, a {fmt.upper()} weight of {out_in} needs "
                + " or ".join(str(s) for s in shapes),
                FIX_DIR,
            )
    if fmt == "nvfp4" and headers[base + "weight_scale"].dtype != "F8_E4M3":
        raise CheckpointError(
            f"{file}: '{base}weight_scale' is {headers[base + 'weight_scale'].dtype}, NVFP4 block scales are F8_E4M3",
            FIX_DIR,
        )


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
            stored_as = fmt if h.dtype == "U8" else "fp8"
            if (h.dtype == "U8") != (
                fmt != "fp8"
            ):  # F8_E4M3 weights under FP8 only, packed U8 under the rest
                raise CheckpointError(
                    f"{h.file}: tensor '{name}' is {h.dtype}, which a {quant_algo} checkpoint does not store",
                    "hf_quant_config.json's quant_algo does not describe these weights: " + FIX_DIR,
                )
            check_scales(name.removesuffix("weight"), stored_as, want, headers, h.file)
            want = packed_shape(stored_as, *want)
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
