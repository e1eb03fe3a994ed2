"""The build manifest: round trip, atomic write, refusal of a changed precision, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.builddir import (
    MANIFEST_NAME,
    BuildManifest,
    hash_files,
    load_manifest,
    load_or_create,
    record_stage,
    save_manifest,
)
from pipeline.errors import DgpipeError
from pipeline.limits import Limits


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


def test_limits_round_trip_as_data():
    """A stage records its limits as a mapping and reads them back: the same object, defaults for the rest."""
    limits = Limits(max_batch=4, max_prompt=1024, max_context=4096)
    assert Limits.from_record(json.loads(json.dumps(limits.engine_values())), "engine.json") == limits
    assert Limits.from_record({"max_batch": 2}, "x") == Limits(max_batch=2)  # others: defaults
    assert Limits.from_record(None, "x") == Limits()
    assert limits.engine_flags() == ["--max-batch", "4", "--max-prompt", "1024", "--max-context", "4096"]
    with pytest.raises(DgpipeError, match=r"engine.json: --max-prompt Input should be a valid integer"):
        Limits.from_record({"max_prompt": "many"}, "engine.json")
    with pytest.raises(
        DgpipeError, match=r"engine.json: --max-batch Input should be greater than or equal to 1"
    ):
        Limits.from_record({"max_batch": 0}, "engine.json")
    with pytest.raises(DgpipeError, match=r"x: --max-tokens-limit Extra inputs are not permitted"):
        Limits.from_record({"max_tokens_limit": 5}, "x")  # an old or misspelled name is refused, not ignored
    with pytest.raises(DgpipeError, match="leaves no room for a 256-token canvas"):
        Limits(max_prompt=8000).validate(canvas=256)
    assert Limits(max_batch=4).merged(max_batch=None, max_tokens=7) == Limits(max_batch=4, max_tokens=7)


def test_context_length_is_prompt_tokens_and_two_canvases():
    from pipeline.limits import context_length

    assert context_length(100, 300, 82) == 100 + 300 + 2 * 82
    assert context_length(7, 0, 8) == 23


def test_one_writer_holds_a_build_dir(tmp_path: Path):
    """A second dgpipe command writing the same build dir (a build, or a stage with --build-dir) is refused
    at once: interleaved, each recorded its options over the other's artifacts, and the next build resumed
    from records that no longer matched the files. The holder itself takes it again freely (a build running
    its stages), and a holder that dies releases it."""
    import subprocess
    import sys

    from pipeline.builddir import LOCK_NAME, build_lock
    from pipeline.serving.repository import package_stage

    with build_lock(tmp_path), build_lock(tmp_path):  # the holder's own stages
        pass
    typo = tmp_path / "typo" / "build"
    with build_lock(typo):  # a stage given a build dir that does not exist: its own check says so
        pass
    assert not (tmp_path / "typo").exists()
    with build_lock(typo, create=True):  # a build makes it
        assert (typo / LOCK_NAME).is_file()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pipeline.builddir import build_lock\n"
         f"with build_lock({str(tmp_path)!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DgpipeError, match="another dgpipe command is writing this build dir"):
            package_stage(tmp_path)
        with pytest.raises(DgpipeError, match="another dgpipe command"), build_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with build_lock(tmp_path):  # released with its process
        pass
