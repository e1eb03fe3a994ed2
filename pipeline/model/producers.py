"""Say what a directory is from its files alone: who wrote it and what dgpipe does with it.

Fine-tuning tools write DiffusionGemma weights in several layouts, and a user passes whichever directory the
tool left. Recognising the producer from its own marker files (never from the directory's name) lets every
command take any of them as `--model` / `--adapter` and lets `dgpipe inspect` say what will happen:

* Hugging Face checkpoint: `config.json` + `*.safetensors` (what transformers' `save_pretrained` writes).
* ModelOpt-quantized: `hf_quant_config.json`, or `quantization_config` in config.json (`export_hf_checkpoint`).
* NeMo AutoModel full SFT: the checkpoint step dir holds `model/`; with `save_consolidated` an HF directory
  `model/consolidated/` (config.json, `model-*.safetensors`, index), otherwise the DCP shards
  `model/shard-*.safetensors` with `model.safetensors.index.json` and the config in `model/.hf_metadata/`.
  Its state-dict adapter folds `router.per_expert_scale` into `experts.down_proj` and writes the scale as
  ones (the product is the same) and does not write the encoder's `layer_scalar` copies.
* NeMo AutoModel LoRA: `adapter_model.safetensors` + `adapter_config.json` + `automodel_peft_config.json`.
* PEFT / Unsloth LoRA: `adapter_model.safetensors` + `adapter_config.json` (Unsloth saves through PEFT's
  `save_pretrained`; its model card is tagged `unsloth`).
* Unsloth merged 16-bit (`save_pretrained_merged`): a Hugging Face checkpoint whose config.json records
  `unsloth_version`.

Sources: github.com/NVIDIA-NeMo/Automodel (nemo_automodel/components/checkpoint/{checkpointing,addons}.py,
components/models/diffusion_gemma/state_dict_adapter.py), github.com/unslothai/unsloth (unsloth/save.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointError

BASE = "hf"
QUANTIZED = "modelopt"
AUTOMODEL_SFT = "automodel-sft"
AUTOMODEL_SHARDED = "automodel-sft-sharded"
AUTOMODEL_LORA = "automodel-lora"
PEFT_LORA = "peft-lora"
UNSLOTH_LORA = "unsloth-lora"
UNSLOTH_MERGED = "unsloth-merged"
ADAPTERS = (AUTOMODEL_LORA, PEFT_LORA, UNSLOTH_LORA)

_DESCRIBE = {
    BASE: ("Hugging Face checkpoint", "loaded as is"),
    QUANTIZED: ("ModelOpt-quantized checkpoint", "loaded as is (dequantized on load; not re-quantized)"),
    AUTOMODEL_SFT: (
        "NeMo AutoModel full SFT (consolidated HF dir)",
        "normalised into a Hugging Face checkpoint (encoder layer_scalar copies restored; the folded "
        "router.per_expert_scale kept as written), cached",
    ),
    AUTOMODEL_SHARDED: (
        "NeMo AutoModel full SFT (sharded model/shard-*.safetensors)",
        "shards gathered with the config from model/.hf_metadata into a Hugging Face checkpoint "
        "(encoder layer_scalar copies restored), cached",
    ),
    AUTOMODEL_LORA: (
        "NeMo AutoModel LoRA adapter",
        "merged into its base (W += alpha/r * B @ A, AutoModel's formula), cached",
    ),
    PEFT_LORA: ("PEFT LoRA adapter", "merged into its base (PEFT's formula: alpha/r, rsLoRA alpha/sqrt(r))"),
    UNSLOTH_LORA: (
        "Unsloth LoRA adapter (PEFT format)",
        "merged into its base (PEFT's formula: alpha/r, rsLoRA alpha/sqrt(r)), cached",
    ),
    UNSLOTH_MERGED: ("Unsloth merged 16-bit checkpoint", "loaded as is"),
}


@dataclass
class Recognised:
    """What a directory is. `weights` is the directory whose files hold the weights (an AutoModel step dir
    points into `model/consolidated`); `base` is an adapter's recorded base model."""

    path: str
    kind: str
    producer: str
    what: str
    action: str
    weights: str
    base: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def is_adapter(self) -> bool:
        return self.kind in ADAPTERS

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"is_adapter": self.is_adapter}


def _json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})", "the file is damaged") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw


def _make(path: Path, kind: str, producer: str, weights: Path, **kw: Any) -> Recognised:
    what, action = _DESCRIBE[kind]
    return Recognised(str(path), kind, producer, what, action, str(weights), **kw)


def _adapter(path: Path) -> Recognised:
    cfg = _json(path / "adapter_config.json")
    base = cfg.get("base_model_name_or_path")
    notes = [f"r={cfg.get('r')}, lora_alpha={cfg.get('lora_alpha')}"]
    if cfg.get("use_rslora"):
        notes.append("rsLoRA: scale alpha/sqrt(r)")
    card = path / "README.md"
    if (path / "automodel_peft_config.json").is_file():
        kind, producer = AUTOMODEL_LORA, "NeMo AutoModel"
    elif card.is_file() and "unsloth" in card.read_text(encoding="utf-8", errors="replace").lower():
        kind, producer = UNSLOTH_LORA, "Unsloth"
    else:
        kind, producer = PEFT_LORA, "PEFT"
    rec = _make(path, kind, producer, path, base=base, notes=notes)
    _merge_outlook(rec, cfg, path)
    return rec


def _merge_outlook(rec: Recognised, cfg: dict[str, Any], path: Path) -> None:
    """What `--adapter` will do with it, told before it is tried: the refusal of a variant the merge would
    get wrong, and which passes a one-copy adapter was trained on (`pipeline.model.lora`)."""
    from pipeline.errors import DgpipeError
    from pipeline.model import lora

    try:
        lora.check_config(cfg, path)
    except DgpipeError as e:
        rec.action = f"refused: {e}"
        return
    try:
        from safetensors import safe_open

        with safe_open(path / "adapter_model.safetensors", "pt") as f:
            keys = list(f.keys())
    except Exception:  # a missing or damaged file: the merge names it
        return
    note = lora.one_copy_note(lora.adapted_copies(keys))
    if note:
        rec.notes.append(note)


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


# layouts whose weights dir is a Hugging Face checkpoint as it is, checked in place by `inspect_dir`
CHECKED_IN_PLACE = (BASE, QUANTIZED, UNSLOTH_MERGED, AUTOMODEL_SFT)


def inspect_dir(path: str | Path) -> Recognised:
    """`dgpipe inspect`: what `path` is and, for a checkpoint loaded from its own files, whether dgpipe
    takes it: its config and every tensor's name, shape and dtype checked from the headers as the loading
    commands check them (the weights themselves are not read: a NaN is found when they are)."""
    from pipeline.model.validate import validate_checkpoint

    rec = recognise(path)
    if rec.kind in CHECKED_IN_PLACE:
        try:
            validate_checkpoint(rec.weights)
        except CheckpointError as e:
            rec.action = f"refused: {e}"
        else:
            rec.notes.append("config and tensor headers checked (the weights are read when loaded)")
    return rec


def recognise(path: str | Path) -> Recognised:
    """What `path` is, from its marker files; a directory that is none of the known layouts is refused
    with the list of what was looked for."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"{p}: no such checkpoint directory", "pass a checkpoint, adapter or AutoModel checkpoint dir"
        )
    if (p / "adapter_config.json").is_file():
        return _adapter(p)
    notes: list[str] = []
    steps = sorted(p.glob("epoch_*_step_*"), key=_step_number)
    if steps and not (p / "config.json").is_file():  # an AutoModel checkpoint_dir: its latest step
        notes.append(f"latest of {len(steps)} AutoModel checkpoint step(s): {steps[-1].name}")
        p = steps[-1]
    # an AutoModel checkpoint step dir (epoch_E_step_S/) or its model/ dir
    model_dir = p / "model" if (p / "model").is_dir() and not (p / "config.json").is_file() else p
    if (model_dir / "adapter_config.json").is_file():
        rec = _adapter(model_dir)
        rec.notes[:0] = notes
        return rec
    if (model_dir / "consolidated" / "config.json").is_file():
        return _make(p, AUTOMODEL_SFT, "NeMo AutoModel", model_dir / "consolidated", notes=notes)
    if any(model_dir.glob("shard-*.safetensors")):
        meta = model_dir / ".hf_metadata"
        if not (meta / "config.json").is_file():
            raise CheckpointError(
                f"{model_dir}: AutoModel shards without .hf_metadata/config.json",
                "copy the base model's config.json into .hf_metadata/ or save with save_consolidated",
            )
        return _make(p, AUTOMODEL_SHARDED, "NeMo AutoModel", model_dir, notes=notes)
    if (p / "config.json").is_file() and _has_weights(p):
        config = _json(p / "config.json")
        if (p / "hf_quant_config.json").is_file() or "quantization_config" in config:
            from pipeline.model.modelopt import quantization_info

            if not (p / "hf_quant_config.json").is_file() and quantization_info(p) is None:
                method = (config.get("quantization_config") or {}).get("quant_method", "an unnamed method")
                raise CheckpointError(
                    f"{p}: quantized by {method} (config.json's quantization_config), which dgpipe does not read",
                    "quantize the base checkpoint with `dgpipe quantize` (NVIDIA ModelOpt), or use the unquantized one",
                )
            return _make(p, QUANTIZED, "NVIDIA ModelOpt", p)
        if config.get("unsloth_version"):
            return _make(p, UNSLOTH_MERGED, "Unsloth", p, notes=[f"unsloth {config['unsloth_version']}"])
        if _is_automodel_consolidated(p):
            return _make(p, AUTOMODEL_SFT, "NeMo AutoModel", p)
        return _make(p, BASE, "Hugging Face", p)
    raise CheckpointError(
        f"{p}: not a checkpoint dgpipe knows (looked for config.json + *.safetensors, adapter_config.json, "
        "model/consolidated/, model/shard-*.safetensors)",
        "pass a Hugging Face checkpoint, a LoRA adapter dir or a NeMo AutoModel checkpoint dir",
    )


def _step_number(d: Path) -> int:
    tail = d.name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _is_automodel_consolidated(p: Path) -> bool:
    """A consolidated AutoModel dir passed directly: `model/consolidated/` beside AutoModel's own
    `model/.hf_metadata/` or its DCP shards (a plain HF dir named `consolidated` is just that)."""
    parent = p.resolve().parent
    return p.resolve().name == "consolidated" and (
        (parent / ".hf_metadata").is_dir() or any(parent.glob("shard-*.safetensors"))
    )
