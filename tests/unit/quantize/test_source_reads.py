"""The quantize stage reads the source weights once before loading the model: validation (names, shapes,
NaN/inf) and the build manifest's content hash come from one sequential pass, and a caller that validated
the source already (`dgpipe build`) hands that value on, so nothing reads the weights again.

Reads are measured at the file layer: every `open()` of a source weight file is wrapped to count the bytes
it returns (the model load itself maps the files through safetensors, which is the quantization's own read)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt not installed")
pytest.importorskip("transformers", reason="transformers not installed")

from pipeline.builddir import MANIFEST_NAME, checkpoint_hash
from pipeline.model.validate import validate_checkpoint
from pipeline.resources import EMBEDDED_MODEL
from quantize.run import QuantizeOptions
from quantize.stage import quantize_stage


class _Counted:
    """A file object that adds the bytes read through it to `counts[path]`."""

    def __init__(self, fh: Any, path: Path, counts: dict[Path, int]) -> None:
        self._fh, self._path, self._counts = fh, path, counts

    def read(self, *args: Any) -> bytes:
        data = self._fh.read(*args)
        self._counts[self._path] += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self._fh.readinto(buf)
        self._counts[self._path] += n or 0
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()


@pytest.fixture
def weight_reads(monkeypatch) -> dict[Path, int]:
    """Bytes read from each source weight file through open(), from now on."""
    counts = {p.resolve(): 0 for p in EMBEDDED_MODEL.glob("*.safetensors")}
    real_open = builtins.open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, *args, **kwargs)
        path = Path(file).resolve() if isinstance(file, str | Path) else None
        return _Counted(fh, path, counts) if path in counts else fh

    monkeypatch.setattr(builtins, "open", counting_open)
    return counts


def _sizes() -> dict[Path, int]:
    return {p.resolve(): p.stat().st_size for p in EMBEDDED_MODEL.glob("*.safetensors")}


def test_validation_and_hash_are_one_read_of_the_weights(weight_reads):
    source = validate_checkpoint(EMBEDDED_MODEL, weights=True)
    assert weight_reads == _sizes()  # every byte once: the check and the hash share the pass
    assert source.sha256 == checkpoint_hash(EMBEDDED_MODEL)  # the same hash a separate pass gives
    assert set(source.headers) and source.quant_algo is None


def test_build_hands_its_validated_source_to_the_quantize_stage(tmp_path, weight_reads):
    """What `dgpipe build` does: validate once, record the hash, give the value to the quantize stage."""
    source = validate_checkpoint(EMBEDDED_MODEL, weights=True)
    after_validation = dict(weight_reads)
    res = quantize_stage(
        QuantizeOptions(EMBEDDED_MODEL, "bf16", tmp_path / "unused"), tmp_path, source=source
    )
    assert weight_reads == after_validation == _sizes()  # the stage read nothing of the source again
    assert res.details["precision"] == "bf16" and (tmp_path / "checkpoint" / "model.safetensors").is_file()


def test_quantize_stage_alone_reads_the_source_once(tmp_path, weight_reads):
    """`dgpipe quantize --build-dir`: the stage validates and hashes the source itself, in one pass."""
    quantize_stage(QuantizeOptions(EMBEDDED_MODEL, "bf16", tmp_path / "unused"), tmp_path)
    assert weight_reads == _sizes()
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["model_sha256"] == checkpoint_hash(EMBEDDED_MODEL)
