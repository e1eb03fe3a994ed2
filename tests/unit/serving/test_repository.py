"""`dgpipe package` output, checked without a server: the config parses with Triton's own schema."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'dgpipe[serve]'")

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.serving.repository import package


def test_repository_layout_and_config(tiny_checkpoint: Path, tmp_path: Path):
    repo = package(tiny_checkpoint, tmp_path / "repo", limits=Limits(max_batch=4, max_tokens=300))
    cfg = text_format.Parse((repo / "dgpipe" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled
    inputs = {i.name: i for i in cfg.input}
    assert inputs["max_tokens"].data_type == mc.TYPE_INT32
    assert all(i.optional for i in inputs.values())  # text_input or messages: the model checks one is sent
    assert cfg.parameters["max_batch"].string_value == "4"
    assert cfg.parameters["max_tokens"].string_value == "300"
    assert cfg.parameters["compile"].string_value == "false"  # eager unless `package --compile`
    assert "${" not in (repo / "dgpipe" / "config.pbtxt").read_text()
    assert (repo / "dgpipe" / "1" / "model.py").read_text().startswith('"""Triton Python-backend model')
    assert (repo / "dgpipe" / "1" / "checkpoint" / "model.safetensors").is_file()
    warm = cfg.model_warmup[0]
    data = (repo / "dgpipe" / "warmup" / warm.inputs["text_input"].input_data_file).read_bytes()
    (n,) = struct.unpack("<I", data[:4])
    assert n == len(data) - 4 and data[4:] == b"Hello"


def test_compile_is_a_model_parameter(tiny_checkpoint: Path, tmp_path: Path):
    """`package --compile` sets the parameter the Triton model reads to compile its passes at load."""
    repo = package(tiny_checkpoint, tmp_path / "repo", compile=True)
    cfg = text_format.Parse((repo / "dgpipe" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert cfg.parameters["compile"].string_value == "true"
    model_py = (repo / "dgpipe" / "1" / "model.py").read_text()
    assert 'params.get("compile", "false") == "true"' in model_py


def test_broken_checkpoint_writes_nothing(tmp_path: Path):
    with pytest.raises(DgpipeError, match="no such checkpoint directory"):
        package(tmp_path / "missing", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_dgpipe_package_defaults_are_the_limits(tiny_checkpoint: Path, tmp_path: Path):
    """`dgpipe package` without limits writes the Limits defaults into config.pbtxt (the Triton model reads them
    there; the prompt limit within the model's positions), and the model lands in the layout's version dir."""
    import subprocess
    import sys

    from pipeline.builddir import MODEL_NAME, TRITON_MODEL_FILE, model_version_dir
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.serving.schema import prompt_limit

    out = tmp_path / "repo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "package",
            "--model",
            str(tiny_checkpoint),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = text_format.Parse((out / MODEL_NAME / "config.pbtxt").read_text(), mc.ModelConfig())
    limits = Limits()
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    config = open_checkpoint(tiny_checkpoint).config
    positions = config.text_config.max_position_embeddings
    assert positions - config.canvas_length < limits.max_prompt  # the tiny model holds less than the cap
    assert {k: params[k] for k in ("max_batch", "max_tokens", "max_steps", "max_request_seconds")} == {
        "max_batch": str(limits.max_batch),
        "max_tokens": str(limits.max_tokens),
        "max_steps": str(limits.max_steps),
        "max_request_seconds": str(limits.max_request_seconds),
    }
    assert params["max_prompt"] == str(prompt_limit(limits.max_prompt, positions, config.canvas_length))
    assert (
        prompt_limit(limits.max_prompt, positions, config.canvas_length) == positions - config.canvas_length
    )
    assert (model_version_dir(out) / TRITON_MODEL_FILE).is_file()


def test_prompt_limit_is_the_cap_within_the_models_positions():
    from pipeline.serving.schema import prompt_limit

    assert prompt_limit(2048, 131_072, 256) == 2048  # the cap
    assert prompt_limit(2048, 512, 82) == 430  # a 512-position model holds 430 prompt tokens + one canvas
    assert prompt_limit(2048, 64, 82) == 0  # nothing fits: `package` refuses it


def test_package_refuses_limits_outside_int32(tiny_checkpoint: Path, tmp_path: Path):
    with pytest.raises(DgpipeError, match=r"--max-tokens .*less than or equal to 2147483647"):
        package(tiny_checkpoint, tmp_path / "repo", limits=Limits.of(max_tokens=2**31))
    assert not (tmp_path / "repo").exists()
