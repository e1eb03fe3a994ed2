"""Each stage runs alone on a build directory and records itself in its manifest the way `dgpipe build`
does: quantize -> export -> package, one command each, then the manifest names every artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.builddir import LOCK_NAME
from tests._utils.cli import dgpipe

pytest.importorskip("modelopt", reason="nvidia-modelopt is not installed (pip install dgpipe[quantize])")
pytest.importorskip("onnxruntime", reason="onnx/onnxruntime are not installed (pip install dgpipe[engine])")
pytest.importorskip("tritonclient", reason="tritonclient is not installed (pip install dgpipe[serve])")


def test_quantize_export_package_one_command_each(tmp_path: Path):
    build = tmp_path / "build"
    steps = [
        ("quantize", "--precision", "fp8", "--calib-size", "4", "--build-dir", str(build)),
        ("export", "--build-dir", str(build)),
        ("package", "--build-dir", str(build), "--max-batch", "2"),
    ]
    for step in steps:
        proc = dgpipe(*step)
        assert proc.returncode == 0, (step[0], proc.stderr)
        if step[0] == "quantize":  # ModelOpt's and transformers' lines went to build.log, not the console
            assert "Tied weight" not in proc.stderr and "third-party output in" in proc.stderr
            assert "Tied weight" in (build / "build.log").read_text()
    manifest = json.loads((build / "build_manifest.json").read_text())
    assert manifest["precision"] == "fp8" and manifest["model_sha256"]
    stages = manifest["stages"]
    assert list(stages) == ["quantize", "export", "package"]
    assert stages["quantize"]["outputs"] == {"checkpoint": "checkpoint"}
    assert stages["export"]["inputs"] == {"checkpoint": "checkpoint"}  # export read the quantized checkpoint
    assert stages["export"]["details"]["custom_ops"]  # the sampler ops are in the graph
    assert stages["package"]["outputs"] == {"model_repository": "model_repository"}
    assert all(s["finished_at"] for s in stages.values())
    config = (build / "model_repository" / "dgpipe" / "config.pbtxt").read_text()
    assert "max_batch" in config and 'string_value: "2"' in config
    assert (build / "model_repository" / "dgpipe" / "1" / "checkpoint" / "hf_quant_config.json").is_file()


def test_a_stage_refuses_another_precision_in_the_same_build_dir(tmp_path: Path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "build_manifest.json").write_text(
        json.dumps({"model": "m", "precision": "nvfp4", "targets": ["sm100"], "stages": {}})
    )
    proc = dgpipe("quantize", "--precision", "fp8", "--build-dir", str(build))
    assert proc.returncode == 2
    assert "was built for precision=nvfp4, not fp8" in proc.stderr
    # nothing else written (the lock of the command that writes the build dir is empty)
    assert sorted(p.name for p in build.iterdir()) == [LOCK_NAME, "build_manifest.json"]
    assert (build / LOCK_NAME).stat().st_size == 0
