"""What `dgpipe deploy` and `dgpipe manifests` read from the user, checked before use: image references by
the registries' reference grammar, and render.json by its schema and by the namespace and image rules
`dgpipe manifests` applies to its options. Each refusal is one error line naming the input and a fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.deploy import render as mf
from pipeline.errors import DgpipeError
from tests._utils.k8s import IMAGE

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "ref",
    [
        "nvcr.io/nvidia/tritonserver:25.01-py3",
        f"localhost:5000/a/b@{DIGEST}",
        f"registry.example.com:443/team/dgpipe-triton:1.2.3@{DIGEST}",
        "dgpipe-triton:0.4.0",
        "a__b/c-d.e_f:v1",
        "[::1]:5000/a:1",
        "Registry.Example.COM/x:1",  # a domain may hold capitals, a path may not
    ],
)
def test_valid_image_references_are_accepted(ref: str):
    image = mf.parse_image(ref)
    assert str(image) == ref


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("-rm/x:1", "is not a valid image reference"),
        ("--rm:1", "is not a valid image reference"),
        ("x/-rm:1", "is not a valid image reference"),
        ("x/UPPER:1", "is not a valid image reference"),
        ("a//b:1", "is not a valid image reference"),
        ("a/b/:1", "is not a valid image reference"),
        ("a/b:-tag", "is not a valid image reference"),
        ("a/b:" + "t" * 129, "is not a valid image reference"),
        ("a b:1", "is not a valid image reference"),
        ("a/b:1@", "is not a valid image reference"),
        ("a/b@sha256:abc", "is not a valid image reference"),
        ("a/b:1;rm -rf /", "is not a valid image reference"),
        ("a" * 256 + ":1", "is not a valid image reference"),
        ("a/b@sha512:" + "0" * 128, "the digest is not sha256:<64 lowercase hex digits>"),
        ("a/b@sha256:" + "A" * 64, "the digest is not sha256:<64 lowercase hex digits>"),
    ],
)
def test_invalid_image_references_are_refused(ref: str, words: str):
    with pytest.raises(DgpipeError) as e:
        mf.parse_image(ref)
    assert f"--image {ref!r}" in str(e.value) and words in str(e.value) and e.value.hint


def test_manifests_cli_refuses_an_option_like_image(tmp_path: Path, monkeypatch, capsys):
    from pipeline.cli import main

    out = tmp_path / "k8s"
    argv = ["dgpipe", "manifests", "--target", "dgx-b200", "--image", "-rm/x:1", "--output", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert (
        err.startswith("error: --image '-rm/x:1' is not a valid image reference") and "Traceback" not in err
    )
    assert len(err.strip().splitlines()) == 1 and not out.exists()


# ---- render.json -------------------------------------------------------------------------------------
@pytest.fixture
def summary() -> dict:
    """A render.json as `dgpipe manifests` writes it (the files themselves are not needed to read it)."""
    values = mf.resolve("dgx-h200", IMAGE, namespace="serving")
    files = {mf.STORAGE_FILE: [], mf.SERVING_FILE: [], mf.SMOKE_FILE: [], mf.LOADER_FILE: []}
    return {**mf.summary(values, files), mf.DIGESTS: {}}


def _write(tmp_path: Path, content: dict | str | bytes) -> Path:
    if isinstance(content, dict):
        content = json.dumps(content)
    (tmp_path / mf.RENDER_SUMMARY).write_bytes(content if isinstance(content, bytes) else content.encode())
    return tmp_path


def test_a_written_render_json_reads_back(tmp_path: Path, summary: dict):
    info = mf.load_summary(_write(tmp_path, json.dumps(summary)))
    assert info["namespace"] == "serving" and info["image"] == IMAGE
    assert info["workload"] == {"kind": "Deployment", "name": mf.WORKLOAD}
    assert info["gpu_target"] == summary["gpu_target"]  # informational fields pass through


def _edit(**change):
    return lambda s: {**s, **change}


def _drop(key: str):
    return lambda s: {k: v for k, v in s.items() if k != key}


RENDER_CASES = {
    "not-json": (lambda s: "{namespace: serving", "not valid JSON (Expecting property name"),
    "not-utf8": (lambda s: b'{"namespace": "\xff"}', "not valid JSON (not UTF-8)"),
    "a-list": (lambda s: json.dumps([s]), "holds a JSON list, not an object"),
    "null": (lambda s: "null", "holds a JSON NoneType, not an object"),
    "namespace-number": (_edit(namespace=7), "'namespace': Input should be a valid string"),
    "namespace-missing": (_drop("namespace"), "'namespace': Field required"),
    "files-string": (_edit(files="dgpipe.yaml"), "'files': Input should be a valid dictionary"),
    "workload-kind": (_edit(workload={"kind": "DaemonSet", "name": "x"}), "'workload.kind': Input should be"),
    "config-list": (_edit(config=["DGPIPE_BUILD_DIR"]), "'config': Input should be a valid dictionary"),
    "digests-list": (_edit(digests=["x"]), "'digests': Input should be a valid dictionary"),
    "kube-system": (_edit(namespace="kube-system"), "namespace kube-system: a system or shared namespace"),
    "default-namespace": (_edit(namespace="default"), "namespace default: a system or shared namespace"),
    "namespace-not-dns": (_edit(namespace="Bad_NS"), "namespace 'Bad_NS' is not a valid namespace name"),
    "image-option-like": (_edit(image="-rm/x:1"), "image '-rm/x:1' is not a valid image reference"),
    "image-unpinned": (_edit(image="a/b:latest"), "':latest' is not a pinned version"),
}


@pytest.mark.parametrize("case", sorted(RENDER_CASES))
def test_bad_render_json_is_refused(tmp_path: Path, summary: dict, case: str):
    make, words = RENDER_CASES[case]
    d = _write(tmp_path, make(summary))
    with pytest.raises(DgpipeError) as e:
        mf.load_summary(d)
    message = str(e.value)
    assert message.startswith(f"{d / mf.RENDER_SUMMARY}: ") and words in message, message
    assert e.value.hint and "\n" not in message


def test_oversized_render_json_is_refused(tmp_path: Path, monkeypatch, summary: dict):
    d = _write(tmp_path, json.dumps(summary))
    monkeypatch.setattr(mf, "RENDER_SUMMARY_MAX_BYTES", 64)
    with pytest.raises(DgpipeError, match=r"render\.json: larger than"):
        mf.load_summary(d)


@pytest.mark.parametrize("case", ["not-json", "a-list", "kube-system", "namespace-number"])
def test_deploy_cli_refuses_a_bad_render_json(tmp_path: Path, summary: dict, monkeypatch, capsys, case: str):
    """The same cases through `dgpipe deploy --dry-run`: exit 2, one line, no plan against the namespace."""
    from pipeline.cli import main

    d = _write(tmp_path, RENDER_CASES[case][0](summary))
    monkeypatch.setattr(sys, "argv", ["dgpipe", "deploy", "--manifests", str(d), "--dry-run"])
    with pytest.raises(SystemExit) as e:
        main()
    captured = capsys.readouterr()
    assert e.value.code == 2, captured.err
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and RENDER_CASES[case][1] in captured.err
    assert "plan:" not in captured.out


def test_manifests_of_a_build_dir_with_no_target_yet_is_one_error(tmp_path: Path):
    """What `dgpipe quantize --build-dir` (or `export --build-dir`) alone leaves records no GPU target: the
    error says which stage is missing and the command that finishes the build (it was an IndexError)."""
    from pipeline.builddir import BuildManifest, save_manifest

    save_manifest(tmp_path, BuildManifest(model="m", precision="fp8", targets=[]))
    with pytest.raises(DgpipeError, match="records no GPU target") as e:
        mf.resolve("dgx-h100", IMAGE, build_dir=tmp_path)
    assert f"dgpipe build --build-dir {tmp_path} --precision fp8 --target sm90" in str(e.value.hint)
