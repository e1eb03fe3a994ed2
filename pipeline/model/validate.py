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
* with `weights=True`, every floating tensor is finite, in one sequential pass over the weight files that
  also computes the checkpoint's content hash (`load_model` checks the tensors it reads itself, so
  loading never pays for it twice).

The result, a `ValidatedCheckpoint`, carries the config, the tensor headers and the hash on: a build
validates its source once and hands that value to the quantize stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from pipeline.model.checkpoint import Checkpoint, open_checkpoint
from pipeline.model.files import TensorHeader, tensor_headers, weight_files, weights_pass
from pipeline.model.modelopt import quant_algo
from pipeline.model.shapes import check_tensors


@dataclass
class ValidatedCheckpoint(Checkpoint):
    """A checkpoint that passed `validate_checkpoint`, with what the check read: later stages take it
    instead of opening, checking and hashing the source again (~52 GB per pass at 26B)."""

    headers: dict[str, TensorHeader] = field(default_factory=dict)  # every tensor, from the headers
    quant_algo: str | None = None  # ModelOpt's quant_algo, None when unquantized
    sha256: str | None = None  # content hash (`pipeline.builddir.checkpoint_hash`); None: weights unread

    @property
    def tensor_names(self) -> set[str]:
        return set(self.headers)


def validate_checkpoint(path: str | Path, weights: bool = False) -> ValidatedCheckpoint:
    """Open and check a checkpoint before any work (see the module docstring). `weights=True` also reads
    every weight file once, in order, refusing NaN/inf and computing the content hash from the same bytes
    (for commands that do not load the weights themselves, and for builds, which record the hash)."""
    ckpt = open_checkpoint(path)  # directory scan, bounded JSON reads, config schema and limits
    headers = tensor_headers(weight_files(ckpt.path))
    algo = quant_algo(ckpt.path)
    check_tensors(ckpt.config, headers, algo, ckpt.path)
    sha256 = weights_pass(ckpt.path, headers) if weights else None
    base = {f.name: getattr(ckpt, f.name) for f in fields(Checkpoint)}
    return ValidatedCheckpoint(**base, headers=headers, quant_algo=algo, sha256=sha256)
