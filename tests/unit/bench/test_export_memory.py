"""The export-memory bench's sparse checkpoint writer: a real safetensors file whose data is a file hole.

The full-depth 26B bench relies on three things the tests pin: the file reads back through the safetensors
library with the header we meant (names, shapes, dtypes) and zero values; its data occupies ~no disk blocks;
and the checkpoint it makes passes the validator (finite-weights pass included) and streams to ONNX.
"""

from __future__ import annotations

import os
from collections import namedtuple

import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors import safe_open

from pipeline.bench import export_memory
from pipeline.bench.export_memory import (
    check_disk,
    checkpoint_bytes,
    disk_needed,
    model_config,
    write_random_checkpoint,
    write_sparse_safetensors,
)
from pipeline.errors import DgpipeError
from pipeline.onnx import contract as onnx_io

TENSORS = {
    "a.weight": ((1024, 2048), torch.bfloat16),  # 4 MiB: the hole is what st_blocks measures
    "b.bias": ((7,), torch.float32),
    "c.scale": ((2, 3, 5), torch.float16),
}


def test_sparse_shard_reads_back_as_zeros_with_the_header_it_was_given(tmp_path):
    f = tmp_path / "shard.safetensors"
    size = write_sparse_safetensors(f, TENSORS)
    assert size == 1024 * 2048 * 2 + 7 * 4 + 30 * 2
    with safe_open(f, "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
        assert sorted(fh.keys()) == sorted(TENSORS)
        for name, (shape, dtype) in TENSORS.items():
            t = fh.get_tensor(name)
            assert t.dtype == dtype and tuple(t.shape) == shape
            assert not t.any()
    st = os.stat(f)
    assert st.st_size > size  # header + the whole logical data region
    assert st.st_blocks * 512 < 64 << 10, st.st_blocks  # the 4 MiB of data is a hole: one header block


def test_sparse_checkpoint_validates_and_streams_to_an_all_zero_export(tmp_path):
    from pipeline.model.validate import validate_checkpoint
    from pipeline.onnx.stream import export_streaming

    cfg = model_config("sudoku-tiny", None)
    total = write_random_checkpoint(tmp_path / "ckpt", cfg, sparse=True)
    assert total == checkpoint_bytes(cfg)
    validate_checkpoint(tmp_path / "ckpt", weights=True)  # zeros are finite; every name/shape is there
    export_streaming(tmp_path / "ckpt", tmp_path / "onnx")
    m = onnx.load(str(tmp_path / "onnx" / onnx_io.MODEL_FILE), load_external_data=False)
    proj = [t for t in m.graph.initializer if t.name.endswith("q_proj.weight")]
    assert proj
    for t in proj:
        onnx.external_data_helper.load_external_data_for_tensor(t, str(tmp_path / "onnx"))
        w = numpy_helper.to_array(t)
        assert w.size > 0 and not w.any()


def test_disk_check_names_the_bytes_needed_and_the_way_out(tmp_path, monkeypatch):
    cfg = model_config("sudoku-tiny", None)
    size = checkpoint_bytes(cfg)
    assert disk_needed(cfg, sparse=True) == size + (1 << 30)
    assert disk_needed(cfg, sparse=False) == 2 * size + (1 << 30)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(export_memory.shutil, "disk_usage", lambda p: usage(10**9, 0, 10**6))
    need = disk_needed(cfg, sparse=False)
    with pytest.raises(DgpipeError, match=f"needs .* GB free \\({need} bytes.*pass --sparse"):
        check_disk(tmp_path / "not" / "yet", cfg, sparse=False)
    monkeypatch.setattr(export_memory.shutil, "disk_usage", lambda p: usage(10**12, 0, need))
    check_disk(tmp_path / "not" / "yet", cfg, sparse=False)
