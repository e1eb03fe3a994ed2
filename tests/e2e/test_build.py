"""`dgpipe build` on a CPU machine: every stage up to the engine, the node step for the engine, a
repository that serves the quantized checkpoint, and refusals before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._utils.cli import dgpipe

pytest.importorskip("modelopt", reason="nvidia-modelopt is not installed (pip install dgpipe[quantize])")
pytest.importorskip("onnxruntime", reason="onnx/onnxruntime are not installed (pip install dgpipe[engine])")

from pipeline.sampler.kernels.build import find_nvcc


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found: the sampler PTX cannot be compiled")
def test_fp8_build_writes_every_stage_and_defers_the_engine(tmp_path: Path):
    build = tmp_path / "build"
    proc = dgpipe(
        "build",
        "--precision",
        "fp8",
        "--target",
        "sm90,sm100",
        "--calib-size",
        "8",
        "--build-dir",
        str(build),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["targets"] == ["sm90", "sm100"]
    man = json.loads((build / "build_manifest.json").read_text())
    assert list(man["stages"]) == ["quantize", "export", "engine", "package"]
    assert man["precision"] == "fp8" and len(man["model_sha256"]) == 64
    # quantized checkpoint in ModelOpt's layout, ONNX with Q/DQ and our sampler ops, PTX per target
    assert (
        json.loads((build / "checkpoint" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
        == "FP8"
    )
    assert (build / "onnx" / "model.onnx").is_file()
    assert man["stages"]["export"]["details"]["custom_ops"] == [
        "dgpipe::SampleRows",
        "dgpipe::SampleAccept",
        "dgpipe::MoE",  # FP8 experts routed (pipeline.onnx.quant.insert_routed_fp8)
    ]
    for t in ("sm90", "sm100"):
        ptx = (build / "plugins" / t / "dg_sampler.ptx").read_text()
        assert f".target sm_{t[2:]}a" in ptx
        rec = man["stages"]["engine"]["details"]["engines"][t]
        assert rec["status"] == "deferred" and "TensorRT" in rec["reason"]
        assert rec["command"][rec["command"].index("--output") + 1] == "model_repository/dgpipe/1"
    assert "built on the target node" in proc.stderr  # the summary says what happens on the target
    version = build / "model_repository" / "dgpipe" / "1"
    assert (version / "checkpoint" / "hf_quant_config.json").is_file() and (version / "model.py").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "nvfp4", "--target", "sm90"], "use --precision fp8 for sm90"),
        (["--precision", "fp6"], "unknown precision 'fp6'"),
        (["--precision", "fp8", "--target", "sm75"], "unknown GPU target 'sm75'"),
        (["--precision", "fp8", "--model", "/nonexistent"], "no such checkpoint directory"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path, args, message):
    proc = dgpipe("build", *args, "--build-dir", str(tmp_path / "build"))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "build").exists()
