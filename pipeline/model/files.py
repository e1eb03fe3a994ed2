"""Reading a checkpoint's files, safely: the directory scan (no symlink out, no pickle, regular files only),
bounded JSON reads, the tensor names of the Hugging Face layout, safetensors headers (no weight read), and one
sequential pass over the weights that checks them and hashes them together.

The leaf of `pipeline.model`: it needs nothing of the model, so the config schema, the ModelOpt reader, the
shape check and the loader all read files through it.
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

from pipeline.builddir import checkpoint_hash, read_blocks
from pipeline.errors import CheckpointError

if TYPE_CHECKING:
    import torch

MIB = 1 << 20
# The most bytes dgpipe reads of each checkpoint file it parses or copies into a model repository, by name:
# each bound is a few times the largest real file of its kind, so a file past it is garbage or hostile (a
# link to /dev/zero, a 100 MiB "template") and is refused before it is read into memory or copied.
FILE_LIMITS: dict[str, int] = {
    "tokenizer.json": 64 * MIB,  # Gemma's (262k-token vocabulary with merges) is ~33 MB
    "tokenizer_config.json": 8 * MIB,  # Gemma's lists every added token: ~1.2 MB
    "model.safetensors.index.json": 16 * MIB,  # a tensor name per line: ~1 MB for a per-expert 26B MoE
    "config.json": 1 * MIB,  # the model's shape: a few kilobytes
    "special_tokens_map.json": 1 * MIB,  # a handful of named tokens: under a kilobyte
    "chat_template.jinja": 1 * MIB,  # Gemma's template is ~10 KB
    "chat_template.json": 1 * MIB,  # the same template, JSON-quoted
    "generation_config.json": 1 * MIB,  # sampler defaults and end tokens: under a kilobyte
    "dgpipe.json": 1 * MIB,  # prompt format, task, provenance: under a kilobyte
    "hf_quant_config.json": 1 * MIB,  # ModelOpt's quantization record: under a kilobyte
}
DEFAULT_FILE_LIMIT = 1 * MIB  # any other JSON file dgpipe reads from a checkpoint
# the text files dgpipe reads besides config.json, each checked (bounded, UTF-8, JSON parsed) when the
# checkpoint is opened: the tokenizer, its config, the chat template, the generation defaults, dgpipe.json
TEXT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "dgpipe.json",
)
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
            f"{p}: no such checkpoint directory", "pass a checkpoint directory: config.json and *.safetensors"
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
    no symlink leaving it, nothing but regular files and folders, no pickle files. A directory without
    config.json is no checkpoint and is not walked (its files are not the user's checkpoint's)."""
    root = checkpoint_dir(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(
            f"{path}: not a checkpoint (no config.json)",
            "pass a checkpoint directory (config.json and *.safetensors); `dgpipe inspect DIR` says what one is",
        )
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


def file_limit(f: Path) -> int:
    """The most bytes dgpipe reads of this checkpoint file (`FILE_LIMITS`, by name)."""
    return FILE_LIMITS.get(f.name, DEFAULT_FILE_LIMIT)


def read_bytes(f: Path) -> bytes:
    """A checkpoint file's bytes, read with its size bound (a file linked to /dev/zero, or a FIFO, must not
    hang or fill memory): the read stops one byte past the bound, whatever stat says."""
    try:
        st = f.stat()
    except FileNotFoundError as e:
        raise CheckpointError(f"{f}: missing", "a checkpoint directory needs config.json") from e
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{f}: not a regular file", "replace it with the file itself")
    limit = file_limit(f)
    with open(f, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(
            f"{f}: larger than {limit / MIB:g} MiB, the bound for a {f.name}",
            "a real one is far smaller: replace it with the model's own file",
        )
    return data


def read_text(f: Path) -> str:
    """A checkpoint text file (bounded as `read_bytes`), decoded as UTF-8 (JSON and Jinja files are UTF-8;
    anything else is a corrupt file, refused here rather than as a decode error wherever it is used)."""
    data = read_bytes(f)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{f}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})",
            "save it as UTF-8 or replace it with the model's own file",
        ) from e


def read_json(f: Path) -> Any:
    """A JSON file of the checkpoint: bounded, UTF-8, parsed."""
    text = read_text(f)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{f}: not valid JSON ({e.msg} at line {e.lineno})", "fix or replace the file"
        ) from e


def read_json_object(f: Path) -> dict[str, Any]:
    raw = read_json(f)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f}: holds a {type(raw).__name__}, not a JSON object", "fix or replace it")
    return raw


def check_text_files(root: Path) -> None:
    """Every text file of `TEXT_FILES` the checkpoint has is within its bound and valid UTF-8, and the JSON
    ones parse to an object: checked when the checkpoint is opened, before any command reads or copies them.
    tokenizer.json is only decoded here: the tokenizers library parses it (`Checkpoint.tokenizer`)."""
    for name in TEXT_FILES:
        f = root / name
        if not f.exists() and not f.is_symlink():
            continue
        if name.endswith(".json") and name != "tokenizer.json":
            read_json_object(f)
        else:
            read_text(f)


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


# safetensors dtype -> torch dtype name, for the floating tensors the weight pass checks for NaN/inf
CHECKED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}
READ_CHUNK = 64 << 20  # bytes per read of the weight pass (a whole number of elements of every dtype)


def _read_exactly(fh: Any, n: int, f: Path) -> bytearray:
    buf = bytearray(n)
    if fh.readinto(buf) != n:
        raise CheckpointError(f"{f}: shorter than its header says", "the file is truncated: " + FIX_DIR)
    return buf


def checked_blocks(f: Path, checked: set[str]) -> Iterator[bytearray]:
    """Every byte of one safetensors file, in order, read once; on the way each floating tensor named in
    `checked` is refused if it holds NaN/inf (chunk by chunk: finiteness is element-wise, so a 2 GB
    embedding never sits in memory twice). What the caller does with the bytes (hash them) is its business."""
    import torch

    with open(f, "rb") as fh:
        size = _read_exactly(fh, 8, f)
        header = _read_exactly(fh, int.from_bytes(size, "little"), f)  # safe_open accepted it already
        yield size
        yield header
        spans = sorted(
            (int(meta["data_offsets"][0]), int(meta["data_offsets"][1]), name, str(meta["dtype"]))
            for name, meta in json.loads(header).items()
            if name != "__metadata__"
        )
        pos = 0
        for begin, end, name, dtype in spans:
            if begin > pos:
                yield _read_exactly(fh, begin - pos, f)
            check = name in checked and dtype in CHECKED_DTYPES
            pos = max(pos, begin)
            while pos < end:
                buf = _read_exactly(fh, min(READ_CHUNK, end - pos), f)
                if check:
                    check_finite(name, torch.frombuffer(buf, dtype=getattr(torch, CHECKED_DTYPES[dtype])), f)
                yield buf
                pos += len(buf)
        while block := fh.read(READ_CHUNK):
            yield block


def weights_pass(root: Path, headers: dict[str, TensorHeader]) -> str:
    """One sequential read of the checkpoint's weight files: every floating tensor checked for NaN/inf and
    the checkpoint's content hash (`pipeline.builddir.checkpoint_hash`, over the same bytes) returned."""
    names: dict[Path, set[str]] = {}
    for name, h in headers.items():
        names.setdefault(h.file.resolve(), set()).add(name)

    def blocks(f: Path) -> Iterator[bytes | bytearray]:
        checked = names.get(f.resolve())
        return checked_blocks(f, checked) if checked is not None else read_blocks(f)

    return checkpoint_hash(root, blocks)
