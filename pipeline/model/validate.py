"""The one checkpoint validator: every command that reads a checkpoint (`generate`, `package`, `quantize`,
`export`, `build`) calls it before doing any work, so a corrupt or hostile directory is refused with one
line naming the problem and the fix instead of a traceback, a hang, a full disk or an unpickled file.

What it checks, cheapest first:
* the directory itself: regular files and folders only; a symlink must stay inside the checkpoint (or
  point into the Hugging Face cache's `blobs/` folder beside a `snapshots/<rev>` directory); no pickle
  files at all (dgpipe never unpickles and never copies them);
* every file dgpipe reads or copies besides the weights (config.json, the tokenizer and its config, the
  chat template, generation_config.json, dgpipe.json) is read with its size bound
  (`pipeline.model.files.FILE_LIMITS`) and decoded as UTF-8; config.json goes through the typed schema and
  its sanity limits (`pipeline.model.config.CONFIG_LIMITS`) before anything is allocated; tokenizer.json
  must load in the tokenizers library; generation_config.json's sampler defaults must lie in the sampler's
  ranges (`SamplerConfig`, `SAMPLER_RANGES`) with `max_denoising_steps` within the serving cap, and its end
  tokens inside the vocabulary;
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
from typing import Any

from pipeline.errors import CheckpointError, SamplerError
from pipeline.limits import DEFAULTS, Limits
from pipeline.model.checkpoint import Checkpoint, open_checkpoint
from pipeline.model.config import ModelConfig, SamplerConfig
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


GENERATION_FIX = "fix generation_config.json, or delete it to use the published sampler defaults"
# transformers rebuilds generation_config.json's `sampler_config` from the class its `_cls_name` names
SAMPLER_CONFIG_CLASS = "EntropyBoundSamplerConfig"


def check_generation_config(
    raw: dict[str, Any], config: ModelConfig, where: Path, limits: Limits = DEFAULTS
) -> SamplerConfig:
    """generation_config.json's defaults, checked as a request's sampler settings are: each in the sampler's
    range, `max_denoising_steps` within the serving cap (a default past it would be refused on every request
    that does not override it), the sampler config in the form transformers loads, the end tokens in the
    vocabulary. Returns the sampler defaults it describes."""
    sc = raw.get("sampler_config")
    if sc is not None:
        if not isinstance(sc, dict):
            raise CheckpointError(
                f"{where}: 'sampler_config' must be an object (got {type(sc).__name__})", GENERATION_FIX
            )
        if sc.get("_cls_name") != SAMPLER_CONFIG_CLASS:
            raise CheckpointError(
                f"{where}: 'sampler_config._cls_name' must be {SAMPLER_CONFIG_CLASS!r} "
                f"(got {sc.get('_cls_name')!r})",
                GENERATION_FIX,
            )
    try:
        sampler = SamplerConfig.from_generation_config(raw)
    except SamplerError as e:
        raise CheckpointError(f"{where}: {e}", GENERATION_FIX) from e
    if sampler.max_denoising_steps > limits.max_steps:
        raise CheckpointError(
            f"{where}: max_denoising_steps {sampler.max_denoising_steps} is over the serving cap of "
            f"{limits.max_steps} steps per canvas",
            f"set it to at most {limits.max_steps} in generation_config.json",
        )
    new = raw.get("max_new_tokens")
    if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
        raise CheckpointError(
            f"{where}: max_new_tokens {new!r} is not a positive integer (the default max_tokens of a request)",
            GENERATION_FIX,
        )
    eos = raw.get("eos_token_id")
    ids = [eos] if not isinstance(eos, list) else eos
    vocab = config.text_config.vocab_size
    for i in ids:
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab):
            raise CheckpointError(
                f"{where}: eos_token_id {i!r} is not a token id of the {vocab}-token vocabulary",
                GENERATION_FIX,
            )
    return sampler


def validate_checkpoint(
    path: str | Path, weights: bool = False, limits: Limits = DEFAULTS
) -> ValidatedCheckpoint:
    """Open and check a checkpoint before any work (see the module docstring). `weights=True` also reads
    every weight file once, in order, refusing NaN/inf and computing the content hash from the same bytes
    (for commands that do not load the weights themselves, and for builds, which record the hash).
    `limits`: the serving caps the checkpoint's generation defaults must fit."""
    ckpt = open_checkpoint(path)  # directory scan, bounded and decoded text files, config schema and limits
    check_generation_config(ckpt.generation_config, ckpt.config, ckpt.path / "generation_config.json", limits)
    if ckpt.has_tokenizer:
        ckpt.tokenizer()  # loads in the tokenizers library, or is refused naming the file
    headers = tensor_headers(weight_files(ckpt.path))
    algo = quant_algo(ckpt.path)
    check_tensors(ckpt.config, headers, algo, ckpt.path)
    sha256 = weights_pass(ckpt.path, headers) if weights else None
    base = {f.name: getattr(ckpt, f.name) for f in fields(Checkpoint)}
    return ValidatedCheckpoint(**base, headers=headers, quant_algo=algo, sha256=sha256)
