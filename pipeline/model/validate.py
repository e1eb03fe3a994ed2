"""The one checkpoint validator: every command that reads a checkpoint (`generate`, `package`, `quantize`,
`export`, `build`) calls it before doing any work, so a corrupt or hostile directory is refused with one
line naming the problem and the fix instead of a traceback, a hang, a full disk or an unpickled file.

What it checks, cheapest first:
* the directory itself: regular files and folders only; a symlink must stay inside the checkpoint (or
  point into the Hugging Face cache's `blobs/` folder beside a `snapshots/<rev>` directory); no pickle
  files at all (dgpipe never unpickles and never copies them);
* JSON files are read with a size cap (`MAX_JSON_BYTES`), config.json through the typed schema and its
  sanity limits (`pipeline.model.config.CONFIG_LIMITS`) before anything is allocated;
* every tensor's name, dtype and shape, from the safetensors headers only (no weight is read), against
  the shapes the config implies; an index may only name `.safetensors` files inside the directory;
* with `weights=True`, every floating tensor is finite (one pass over the weights; `load_model` does
  the same check on the tensors it reads, so loading never pays for it twice).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from pipeline.model.checkpoint import Checkpoint
    from pipeline.model.config import ModelConfig

MAX_JSON_BYTES = 64 << 20  # a real tokenizer.json is ~33 MB; config/index files are kilobytes
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors names of the dtypes an unquantized weight may have
PACKED_DTYPES = ("U8", "F8_E4M3")  # ModelOpt's packed weights (pipeline.model.modelopt)
SCALE_DTYPES = (*FLOAT_DTYPES, "F8_E4M3")
DECODER = "model.decoder."
SKIPPED_PREFIXES = ("model.encoder.", "lm_head.")  # vision tower, tied encoder copies, tied head
ENCODER_SCALAR = re.compile(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")
PER_EXPERT = re.compile(r"(layers\.\d+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FIX_DIR = "re-download or re-export the checkpoint (dgpipe quantize / save_pretrained)"


def runtime_name(name: str) -> str | None:
    """Checkpoint tensor name -> DiffusionGemma parameter name, or None for tensors the text runtime skips."""
    if name.startswith(DECODER):
        return name[len(DECODER) :]
    m = ENCODER_SCALAR.match(name)
    # everything else is skipped unread: lm_head (tied), the vision tower, the encoder's tied copies
    return f"layers.{m.group(1)}.encoder_layer_scalar" if m else None


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory, resolved (a symlink to the directory itself is the user's choice)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"{p}: no such checkpoint directory", "pass --model DIR with config.json and *.safetensors"
        )
    return p.resolve()


def _allowed_roots(root: Path) -> list[Path]:
    """Where a symlink in the checkpoint may point: inside it, or the HF hub cache's blobs folder
    (`models--x/snapshots/<rev>/config.json -> ../../blobs/<sha>`)."""
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _inside(p: Path, roots: list[Path]) -> bool:
    return any(p == r or p.is_relative_to(r) for r in roots)


def checkpoint_files(path: str | Path) -> list[Path]:
    """Every file of the checkpoint, relative to it, after checking the directory is safe to read and copy:
    no symlink leaving it, nothing but regular files and folders, no pickle files."""
    root = checkpoint_dir(path)
    roots = _allowed_roots(root)
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            entry = Path(dirpath) / name
            rel = entry.relative_to(root)
            st = entry.lstat()
            if stat.S_ISLNK(st.st_mode):
                target = entry.resolve()
                if not _inside(target, roots):
                    raise CheckpointError(
                        f"{entry}: symlink points outside the checkpoint (to {target})",
                        "copy the file into the checkpoint directory or delete the link",
                    )
                if not target.exists():
                    raise CheckpointError(f"{entry}: dangling symlink (to {target})", "delete the link")
                st = target.stat()
                if stat.S_ISDIR(st.st_mode):
                    continue  # a link to a folder inside the checkpoint: its files are listed there
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(
                    f"{entry}: not a regular file (device, FIFO or socket)",
                    "a checkpoint holds regular files only; delete it",
                )
            if name.lower().endswith(PICKLE_SUFFIXES):
                raise CheckpointError(
                    f"{entry}: pickle file in the checkpoint",
                    "dgpipe reads safetensors only and never unpickles or copies pickle files: convert the "
                    "weights to *.safetensors and delete the pickle files",
                )
            found.append(rel)
    return found


def read_json(f: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of the checkpoint, read with a size cap (a config.json linked to /dev/zero, or a FIFO,
    must not hang or fill memory)."""
    try:
        st = f.stat()
    except FileNotFoundError as e:
        raise CheckpointError(f"{f}: missing", "a checkpoint directory needs config.json") from e
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{f}: not a regular file", "replace it with the JSON file itself")
    with open(f, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(
            f"{f}: larger than {limit >> 20} MiB", "a JSON file of a checkpoint is far smaller; replace it"
        )
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
        raise CheckpointError(f"{f}: not valid JSON{where}", "fix or replace the file") from e


def read_json_object(f: Path) -> dict[str, Any]:
    raw = read_json(f)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f}: holds a {type(raw).__name__}, not a JSON object", "fix or replace it")
    return raw


def weight_files(ckpt: Path) -> dict[str, Path]:
    """Map tensor name -> file, from model.safetensors or a sharded index whose shards stay in the dir."""
    index = ckpt / "model.safetensors.index.json"
    single = ckpt / "model.safetensors"
    root = ckpt.resolve()
    if index.is_file():
        wmap = read_json_object(index).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise CheckpointError(f"{index}: has no 'weight_map'", FIX_DIR)
        out = {}
        for name, fname in wmap.items():
            if not isinstance(fname, str) or not fname.endswith(".safetensors"):
                raise CheckpointError(
                    f"{index}: tensor '{name}' maps to {fname!r}, not a .safetensors file", FIX_DIR
                )
            f = ckpt / fname
            if (
                Path(fname).is_absolute()
                or ".." in Path(fname).parts
                or not _inside(f.resolve(), _allowed_roots(root))
            ):
                raise CheckpointError(
                    f"{index}: shard {fname!r} is outside the checkpoint directory",
                    "an index may only name shard files inside the checkpoint",
                )
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing", FIX_DIR)
            out[name] = f
        return out
    if single.is_file():
        return dict.fromkeys(_headers(single), single)
    if any(p.name.lower().endswith(PICKLE_SUFFIXES) for p in ckpt.iterdir()):
        raise CheckpointError(
            f"{ckpt}: only pickle weights found", "dgpipe loads safetensors only; convert the checkpoint"
        )
    raise CheckpointError(f"{ckpt}: no model.safetensors or model.safetensors.index.json", FIX_DIR)


@dataclass(frozen=True)
class TensorHeader:
    file: Path
    dtype: str  # safetensors' name: F32, BF16, U8, F8_E4M3, I32 ...
    shape: tuple[int, ...]


def _headers(f: Path) -> dict[str, TensorHeader]:
    """The tensors of one safetensors file from its header alone (safetensors checks that the header's
    offsets cover the file exactly, so a truncated file fails here)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(f, "pt") as fh:
            out = {}
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                s = fh.get_slice(name)
                out[name] = TensorHeader(f, s.get_dtype(), tuple(s.get_shape()))
            return out
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{f}: not a readable safetensors file ({e})", "the file is truncated or corrupt: " + FIX_DIR
        ) from e


def tensor_headers(files: dict[str, Path]) -> dict[str, TensorHeader]:
    headers: dict[str, TensorHeader] = {}
    for f in dict.fromkeys(files.values()):
        headers.update({n: h for n, h in _headers(f).items() if files.get(n) == f})
    missing = sorted(set(files) - set(headers))
    if missing:
        raise CheckpointError(
            f"{files[missing[0]]}: has no tensor '{missing[0]}' (its index says so)", FIX_DIR
        )
    return headers


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Runtime parameter name -> shape, from a model built on the meta device (no memory)."""
    import torch

    from pipeline.model.network import DiffusionGemma

    with torch.device("meta"):
        model = DiffusionGemma(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _packed_shape(fmt: str, out_dim: int, in_dim: int) -> tuple[int, int]:
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
    from pipeline.model.modelopt import AUX_SUFFIXES, _packed_format

    fmt = _packed_format(quant_algo) if quant_algo else None
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
            want = _packed_shape(fmt if h.dtype == "U8" else "fp8", *want)
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


def check_finite(name: str, t: torch.Tensor, file: Path) -> torch.Tensor:
    """Refuse a NaN/inf weight (checked as each tensor is read: one reduction per tensor)."""
    import torch

    if t.dtype == torch.float8_e4m3fn:
        bad = bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())  # E4M3FN has NaN, no inf
    elif t.is_floating_point():
        bad = not bool(torch.isfinite(t).all())
    else:
        bad = False
    if bad:
        raise CheckpointError(
            f"{file}: tensor '{name}' holds NaN or inf values", "the weights are corrupt: " + FIX_DIR
        )
    return t


def iter_weights(headers: dict[str, TensorHeader]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in dict.fromkeys(h.file for h in headers.values()):
        try:
            with safe_open(f, "pt") as fh:
                for name in fh.keys():  # noqa: SIM118
                    if name in headers:
                        yield name, fh.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read its tensors ({e})", FIX_DIR) from e


def validate_checkpoint(path: str | Path, weights: bool = False) -> Checkpoint:
    """Open and check a checkpoint before any work (see the module docstring); `weights=True` also reads
    every tensor once to refuse NaN/inf (for commands that do not load the weights themselves)."""
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.model.modelopt import quant_algo

    ckpt = open_checkpoint(path)  # directory scan, bounded JSON reads, config schema and limits
    headers = tensor_headers(weight_files(ckpt.path))
    check_tensors(ckpt.config, headers, quant_algo(ckpt.path), ckpt.path)
    if weights:
        for name, t in iter_weights(headers):
            check_finite(name, t, headers[name].file)
    return ckpt
