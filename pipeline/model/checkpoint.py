"""Load (and save) DiffusionGemma checkpoints in Hugging Face layout, from safetensors only.

Never unpickles and never imports code shipped with a checkpoint. Tensors are read lazily one by one,
so the vision tower (and the tied encoder copies) of a real checkpoint are skipped without being read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipeline.atomic import atomic_dir
from pipeline.errors import CheckpointError
from pipeline.model.config import ModelConfig
from pipeline.model.files import (
    DECODER,
    PER_EXPERT,
    check_finite,
    check_text_files,
    checkpoint_files,
    read_json,
    read_json_object,
    read_text,
    runtime_name,
    tensor_headers,
    weight_files,
)
from pipeline.model.modelopt import LINEAR_AUX, PackedLinear, QuantizedLoader, is_packed, quantization_info
from pipeline.model.network import DiffusionGemma, rope_inv_freq
from pipeline.model.shapes import check_tensors


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    generation_config: dict[str, Any] = field(default_factory=dict)
    dgpipe: dict[str, Any] = field(default_factory=dict)  # dgpipe.json: prompt format, task, provenance

    @property
    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").is_file()

    def tokenizer(self):  # -> tokenizers.Tokenizer
        from tokenizers import Tokenizer

        f = self.path / "tokenizer.json"
        if not f.is_file():
            raise CheckpointError(f"{f}: missing", "text prompts need tokenizer.json; or pass token ids")
        text = read_text(f)  # bounded and UTF-8 (FILE_LIMITS)
        try:
            return Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise CheckpointError(
                f"{f}: cannot be read as a tokenizers file ({e})",
                "replace it with the model's tokenizer.json",
            ) from e


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Check the directory (no symlink out, no pickle, regular files only) and read config.json,
    generation_config.json and dgpipe.json with bounded reads; does not touch the weights
    (`pipeline.model.validate.validate_checkpoint` checks those too)."""
    p = Path(path)
    checkpoint_files(p)
    check_text_files(p)  # tokenizer files, template, generation config: bounded, UTF-8, JSON objects
    config = ModelConfig.from_raw(read_json(p / "config.json"), source=str(p / "config.json"))
    gen = read_json_object(p / "generation_config.json") if (p / "generation_config.json").is_file() else {}
    extra = read_json_object(p / "dgpipe.json") if (p / "dgpipe.json").is_file() else {}
    return Checkpoint(path=p, config=config, generation_config=gen, dgpipe=extra)


class PackedSink(Protocol):
    """A caller that keeps some quantized linears in their stored form instead of the loader's dequantized
    float copy (the tensor-core runtime: `pipeline.runtime.gpu_load`). The loader asks `wants` for each
    packed weight's module ("layers.0.self_attn.q_proj", "layers.0.experts.3.gate_proj"), hands the wanted
    ones to `take` as read, and calls `install` once every tensor is in: the sink then puts its modules in
    place of the wanted linears and of every layer's `experts` whose projections it took."""

    def wants(self, module: str) -> bool: ...

    def take(self, module: str, q: PackedLinear) -> None: ...

    def install(self, model: DiffusionGemma) -> None: ...


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    fake_quant_inputs: bool = True,
    packed: PackedSink | None = None,
) -> tuple[DiffusionGemma, Checkpoint]:
    """The runtime model. A ModelOpt-quantized checkpoint is dequantized on load and, with
    `fake_quant_inputs`, its linears' inputs are fake-quantized as the quantized kernels round them (off for
    a float stand-in whose quantization is applied elsewhere, e.g. the ONNX Q/DQ graph); the quantized
    linears `packed` wants are handed to it as stored instead, never dequantized.

    Each tensor goes to `device` and `dtype` as it is read, so the host holds one tensor at a time, not a
    dequantized float copy of the whole model (a 26B FP8 checkpoint is ~100 GB of fp32)."""
    ckpt = open_checkpoint(path)
    files = weight_files(ckpt.path)
    quant = _quantized_loader(ckpt.path)  # ModelOpt export: dequantize on load (pipeline.model.modelopt)
    # names, dtypes and shapes from the headers before a byte of weights is read or allocated
    check_tensors(ckpt.config, tensor_headers(files), quant.algo if quant else None, ckpt.path)
    with torch.device("meta"):
        model = DiffusionGemma(ckpt.config)
    expected = model.state_dict()
    dtype, dev = dtype or torch.float32, torch.device(device)
    state: dict[str, torch.Tensor] = {}
    kept: set[str] = set()  # parameters whose modules `packed` replaces
    handles: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        f = files[name]
        if f not in handles:
            handles[f] = safe_open(f, "pt", device="cpu")
        try:
            return check_finite(name, handles[f].get_tensor(name), f)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read tensor '{name}' ({e})", "the file is corrupt") from e

    def sibling(name: str, suffix: str) -> torch.Tensor | None:
        other = name.rsplit(".", 1)[0] + "." + suffix
        return read(other) if other in files else None

    try:
        for name, f in files.items():
            target = runtime_name(name)
            if target is None or (quant is not None and quant.is_aux(name)):
                continue
            t = read(name)
            module = target.removesuffix(".weight")
            if quant is not None and packed is not None and is_packed(t) and packed.wants(module):
                packed.take(module, PackedLinear(quant.algo, t, **{s: sibling(name, s) for s in LINEAR_AUX}))
                m = PER_EXPERT.search(target)
                kept.update([f"{m.group(1)}.gate_up_proj", f"{m.group(1)}.down_proj"] if m else [target])
                continue
            if quant is not None:
                t = quant.weight(target, t, lambda suffix, n=name: sibling(n, suffix))
            m = PER_EXPERT.search(target)
            if m:  # ModelOpt / vLLM layout: one 2-D tensor per expert and projection, into the fused one
                _fuse_expert(state, expected, m, t, dev, dtype)
                continue
            t = t.to(dev, dtype)
            if target not in expected:
                raise CheckpointError(
                    f"{f}: unexpected tensor '{name}'", "is this a DiffusionGemma checkpoint?"
                )
            state[target] = t
    except SafetensorError as e:
        raise CheckpointError(f"{ckpt.path}: corrupt safetensors ({e})") from e
    for name, ref in expected.items():
        if name in kept:
            continue
        if name.endswith("encoder_layer_scalar") and name not in state:
            scalar = state.get(name.replace("encoder_layer_scalar", "layer_scalar"))
            state[name] = scalar if scalar is not None else torch.ones(1, device=dev, dtype=dtype)
        if name not in state:
            raise CheckpointError(f"{ckpt.path}: tensor 'model.decoder.{name}' is missing from the weights")
        if tuple(state[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{ckpt.path}: tensor 'model.decoder.{name}' has shape {tuple(state[name].shape)}, "
                f"config.json implies {tuple(ref.shape)}"
            )
    model.load_state_dict(state, assign=True, strict=False)  # what is not in `state` is in `kept`
    for kind in set(model.layer_types):  # RoPE tables are not weights: rebuild them off the meta device
        hd = ckpt.config.text_config.layer_shape(model.layer_types.index(kind)).head_dim
        setattr(model, f"inv_freq_{kind}", rope_inv_freq(ckpt.config.text_config, kind, hd).to(dev))
    if packed is not None:
        packed.install(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{ckpt.path}: no weights for {', '.join(left[:3])} after loading")
    model.eval()
    if quant is not None and fake_quant_inputs:
        quant.install(model)  # activation fake-quantization for FP8 / NVFP4
    return model, ckpt


def _fuse_expert(state, expected, m, t: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> None:
    """Copy one expert's projection (`m`: PER_EXPERT's match) into its layer's fused parameter, allocated on
    the layer's first projection: [E, 2I, d] gate|up and [E, d, I] down. Nothing per expert is kept, so the
    loader holds the model plus one tensor. (`check_tensors` has matched every expert's shape and found
    each one present from the headers, so every slot is written.)"""
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    name = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    if name not in state:
        state[name] = torch.empty(expected[name].shape, device=dev, dtype=dtype)
    rows = state[name].shape[1] // 2
    dst = {"down_proj": state[name][e], "gate_proj": state[name][e, :rows], "up_proj": state[name][e, rows:]}
    dst[proj].copy_(t.to(dtype))


def _quantized_loader(path: Path):
    """A `pipeline.model.modelopt.QuantizedLoader` for a ModelOpt-quantized checkpoint, else None."""
    info = quantization_info(path)
    return QuantizedLoader(info) if info else None


def hf_state_dict(model: DiffusionGemma) -> dict[str, torch.Tensor]:
    """Tensor names transformers writes for DiffusionGemmaForBlockDiffusion (tied copies omitted)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("encoder_layer_scalar"):
            layer = name.split(".")[1]
            out[f"model.encoder.language_model.layers.{layer}.layer_scalar"] = t
        else:
            out[DECODER + name] = t
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# what a directory may hold for save_checkpoint to replace it: a checkpoint dgpipe wrote (its dgpipe.json)
SAVED_CHECKPOINT = ("a checkpoint dgpipe wrote", "dgpipe.json")


def save_checkpoint(
    model: DiffusionGemma,
    out: str | Path,
    generation_config: dict[str, Any] | None = None,
    extra_files: dict[str, str | bytes] | None = None,
    dgpipe_meta: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json, model.safetensors, generation_config.json (+ tokenizer etc. via extra_files) atomically."""
    final = Path(out)
    with atomic_dir(final, *SAVED_CHECKPOINT) as tmp:
        state = hf_state_dict(model)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_hf_dict()
        cfg["dtype"] = str(dtype or next(model.parameters()).dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if generation_config is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
        if dgpipe_meta is not None:
            (tmp / "dgpipe.json").write_text(json.dumps(dgpipe_meta, indent=2) + "\n")
        for name, content in (extra_files or {}).items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode) as fh:
                fh.write(content)
    return final
