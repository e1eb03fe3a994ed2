"""The build manifest: round trip, atomic write, refusal of a changed precision, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.builddir import (
    MANIFEST_NAME,
    BuildManifest,
    EngineLimits,
    hash_files,
    load_manifest,
    load_or_create,
    record_stage,
    save_manifest,
)
from pipeline.errors import DgpipeError


def test_round_trip_and_artifact_paths(tmp_path: Path):
    man = BuildManifest(model="sudoku-tiny", precision="fp8", targets=["sm90"])
    man.record("export", outputs={"onnx": "onnx"}, opset=21)
    save_manifest(tmp_path, man)
    back = load_manifest(tmp_path)
    assert back == man
    assert back.stages["export"].details == {"opset": 21}
    assert back.path_of(tmp_path, "onnx") == tmp_path / "onnx"
    assert back.path_of(tmp_path, "engines") == tmp_path / "engines"  # default layout
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]  # no temp file left behind


def test_changed_precision_is_refused(tmp_path: Path):
    save_manifest(tmp_path, BuildManifest(model="m", precision="fp8", targets=["sm90"]))
    with pytest.raises(DgpipeError, match="precision=fp8, not nvfp4"):
        load_or_create(tmp_path, model="m", precision="nvfp4", targets=["sm90"])
    assert load_or_create(tmp_path, model="m", precision="fp8", targets=["sm90"]).precision == "fp8"


def test_missing_and_invalid_manifest_name_the_problem(tmp_path: Path):
    with pytest.raises(DgpipeError, match="no build manifest"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"model": "m", "targets": ["sm90"]}))
    with pytest.raises(DgpipeError, match="precision: Field required"):
        load_manifest(tmp_path)


def test_hash_depends_on_content_and_name(tmp_path: Path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"x" * 10)
    assert hash_files([a]) != hash_files([b])
    h = hash_files([a, b])
    a.write_bytes(b"y" * 10)
    assert hash_files([a, b]) != h


def test_every_stage_records_the_same_way(tmp_path: Path):
    """record_stage: outputs/inputs relative to the build dir when inside it (absolute otherwise), details
    as given, a finish time; the first stage in a new build dir creates the manifest from `create`."""
    build = tmp_path / "build"
    with pytest.raises(DgpipeError, match="no build manifest"):
        record_stage(build, "export", {"onnx": build / "onnx"})
    outside = tmp_path / "ckpt"
    man = record_stage(
        build,
        "export",
        {"onnx": build / "onnx"},
        inputs={"checkpoint": outside},
        details={"opset": 21},
        create={"model": "m", "precision": "fp8", "targets": []},
    )
    rec = load_manifest(build).stages["export"]
    assert rec == man.stages["export"]
    assert (rec.outputs, rec.inputs, rec.details) == (
        {"onnx": "onnx"},
        {"checkpoint": str(outside.resolve())},
        {"opset": 21},
    )
    assert rec.finished_at.endswith("+00:00")
    record_stage(build, "package", {"model_repository": "model_repository"}, details={"engines": False})
    back = load_manifest(build)
    assert list(back.stages) == ["export", "package"]
    assert back.path_of(build, "model_repository") == build.resolve() / "model_repository"


def test_engine_limits_round_trip_through_the_node_command():
    limits = EngineLimits(4, 1024, 4096)
    assert EngineLimits.from_flags(["dgpipe", "engine", "build", *limits.flags()]) == limits
    assert EngineLimits.from_flags(["--max-batch", "2"]) == EngineLimits(max_batch=2)  # others: defaults
    with pytest.raises(DgpipeError, match="engine command for sm90 has a bad --max-prompt"):
        EngineLimits.from_flags(["--max-prompt", "many", "x"], where="engine command for sm90")
    with pytest.raises(DgpipeError, match="leaves no room for a 256-token canvas"):
        EngineLimits(max_prompt=8000).validate(canvas=256)
