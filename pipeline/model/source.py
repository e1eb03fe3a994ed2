"""`--model` / `--adapter` of every command, resolved to one Hugging Face checkpoint directory.

A base, ModelOpt-quantized or Unsloth-merged checkpoint is used where it is. Anything else (an AutoModel SFT
output, a LoRA adapter of any producer) is written once as a plain Hugging Face checkpoint under the cache,
keyed by the inputs' names, sizes and modification times, so build, quantize, generate and package read the
same merged weights and a second command does not merge again. The written directory is what the producer's
own merged model holds: AutoModel's folded `router.per_expert_scale` (ones, with the scale inside
`experts.down_proj`) is kept as written, and the encoder `layer_scalar` copies AutoModel does not write are
restored from the decoder's (transformers ties them; without them its encoder would run with a scale of one).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch

from pipeline.atomic import atomic_dir, json_key
from pipeline.errors import CheckpointError, DgpipeError
from pipeline.model import producers as pr
from pipeline.model.files import TEXT_FILES

SHARD_BYTES = 4 << 30  # tensors per written shard file (transformers' default max_shard_size is 5 GB)
_SCALAR = re.compile(r"^model\.decoder\.layers\.(\d+)\.layer_scalar$")


def _fingerprint(paths: list[Path]) -> str:
    """Names, sizes and mtimes of every file under `paths`: a change to any input makes a new merge."""
    h = hashlib.sha256()
    for root in paths:
        h.update(str(root.resolve()).encode())
        for f in sorted(root.rglob("*")):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _local(name: str | None, given: Path) -> Path | None:
    """A base model the producer recorded by name, if it is a local checkpoint: as written (relative to the
    working dir, as the producer was run) or relative to the output's parent directories."""
    if not name:
        return None
    for root in (Path.cwd(), *given.resolve().parents[:4]):
        if (root / name / "config.json").is_file():
            return root / name
    return None


def _base_of(rec: pr.Recognised) -> Path:
    base = _local(rec.base, Path(rec.weights))
    if base is None:
        raise DgpipeError(
            f"--model {rec.path} is a LoRA adapter whose base '{rec.base}' is not a local directory",
            "pass the base checkpoint as --model and the adapter as --adapter",
        )
    return base


def resolve(model: Path, adapter: Path | None, cache: Path) -> Path:
    """The checkpoint directory a command loads for `--model` (any recognised layout) and `--adapter`. A
    `--model` alone that is no known layout is passed on as given: the loader's own checks (no such dir,
    pickle weights, a symlink out, ...) say what is wrong with it."""
    try:
        rec = pr.recognise(model)
    except CheckpointError:
        if adapter is None:
            return model
        raise
    if rec.is_adapter:
        if adapter is not None:
            raise DgpipeError(f"--model {model} is a LoRA adapter", "pass the base checkpoint as --model")
        model, adapter, rec = _base_of(rec), model, None
        rec = pr.recognise(model)
    if rec.is_adapter:
        raise DgpipeError(f"{model}: the adapter's base is itself an adapter", "merge the first one first")
    ad = pr.recognise(adapter) if adapter is not None else None
    if ad is not None and not ad.is_adapter:
        raise DgpipeError(
            f"--adapter {adapter} is a {ad.what}, not a LoRA adapter", "pass it as --model instead"
        )
    if ad is not None and rec.kind == pr.QUANTIZED:
        raise DgpipeError(
            f"--adapter needs an unquantized base; {model} is ModelOpt-quantized",
            "pass the bf16 base checkpoint as --model",
        )
    if ad is None and rec.kind in (pr.BASE, pr.QUANTIZED, pr.UNSLOTH_MERGED):
        return Path(rec.weights)
    out = cache / "merged" / _fingerprint([model] + ([adapter] if adapter else []))
    if (out / "config.json").is_file():
        return out
    return write_resolved(rec, ad, out)


_AUTOMODEL = (pr.AUTOMODEL_SFT, pr.AUTOMODEL_SHARDED)


def _recorded_base(meta: Path, given: Path) -> Path | None:
    """The base model AutoModel recorded as config.json `_name_or_path`, if it is a local directory."""
    from pipeline.model.files import read_json_object

    name = read_json_object(meta / "config.json").get("_name_or_path")
    return _local(name, given) if isinstance(name, str) else None


def _read_weights(rec: pr.Recognised) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of the checkpoint and the dir holding its config.json and side files."""
    from safetensors.torch import load_file

    from pipeline.model.files import weight_files

    weights = Path(rec.weights)
    if rec.kind == pr.AUTOMODEL_SHARDED:
        files = sorted(weights.glob("shard-*.safetensors"))
        meta = weights / ".hf_metadata"
    else:
        files = sorted(set(weight_files(weights).values()))
        meta = weights
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state, meta


def write_resolved(rec: pr.Recognised, ad: pr.Recognised | None, out: Path) -> Path:
    """Write `rec` (with `ad` merged) as a Hugging Face checkpoint at `out`, atomically."""
    from safetensors.torch import save_file

    from pipeline.model import lora

    state, meta = _read_weights(rec)
    for name in list(state):  # AutoModel drops the tied encoder copies of layer_scalar
        m = _SCALAR.match(name)
        enc = f"model.encoder.language_model.layers.{m.group(1)}.layer_scalar" if m else None
        if enc and enc not in state:
            state[enc] = state[name].clone()
    provenance = {"model": rec.path, "kind": rec.kind, "producer": rec.producer}
    if ad is not None:
        adapter = lora.read_adapter(Path(ad.weights))
        if not lora.same_base(adapter.base, Path(rec.weights)) and not lora.same_base(
            adapter.base, Path(rec.path)
        ):
            raise DgpipeError(
                f"--adapter {ad.path} was trained on '{adapter.base}', not on {rec.path}",
                "merge an adapter into the base model it was trained from",
            )
        merged = lora.merge_into(state, adapter)
        provenance |= {
            "adapter": ad.path,
            "adapter_kind": ad.kind,
            "scaling": adapter.scaling,
            "adapted_copies": sorted(adapter.copies),
            "merged": merged,
        }
    with atomic_dir(out, "a resolved checkpoint", json_key("dgpipe.json", "source")) as tmp:
        _save_sharded(state, tmp, save_file)
        side = _recorded_base(meta, Path(rec.path)) if rec.kind in _AUTOMODEL else None
        if ad is not None:
            side = Path(rec.weights)
        for name in ("config.json", *TEXT_FILES):
            for d in (meta, side):  # AutoModel writes no dgpipe.json (and no tokenizer unless given one)
                if d is not None and (d / name).is_file():
                    shutil.copy2(d / name, tmp / name)
                    break
        if side is not None and ad is None:
            provenance["side_files_from"] = str(side)
        extra = json.loads((tmp / "dgpipe.json").read_text()) if (tmp / "dgpipe.json").is_file() else {}
        extra["source"] = provenance
        (tmp / "dgpipe.json").write_text(json.dumps(extra, indent=2) + "\n")
    return out


def _save_sharded(state: dict[str, torch.Tensor], tmp: Path, save_file) -> None:
    """model.safetensors, or model-XXXXX-of-YYYYY.safetensors + index past SHARD_BYTES (transformers' names)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if len(groups) == 1:
        save_file(groups[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(tmp / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, fname)
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": weight_map,
    }
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
