"""Outputs are replaced as a whole: never a directory the user keeps other things in."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.atomic import atomic_dir
from pipeline.errors import DgpipeError
from tests._utils.cli import dgpipe


def test_an_output_dir_is_replaced_only_when_it_is_an_earlier_output(tmp_path: Path):
    """`--output ~/models` replaced the whole directory: everything else in it was deleted. A directory is
    replaced when absent, empty, or holding this kind's marker; a file or another directory is refused."""
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("keep me")
    with (
        pytest.raises(DgpipeError, match="exists and is not an ONNX export"),
        atomic_dir(kept, "an ONNX export", "contract.json"),
    ):
        pass  # fmt: skip
    assert (kept / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(DgpipeError, match="is not an ONNX export"):
        atomic_dir(tmp_path / "file", "an ONNX export", "contract.json")
    for ours in (tmp_path / "empty", tmp_path / "earlier"):
        ours.mkdir()
    (tmp_path / "earlier" / "contract.json").write_text("{}")
    for ours in (tmp_path / "empty", tmp_path / "earlier", tmp_path / "absent"):
        with atomic_dir(ours, "an ONNX export", "contract.json") as tmp:
            (tmp / "contract.json").write_text("new")
        assert [p.name for p in ours.iterdir()] == ["contract.json"]


@pytest.mark.parametrize(
    "command",
    [
        ["package", "--output"],
        ["export", "--output"],
        ["quantize", "--precision", "fp8", "--output"],
    ],
)
def test_commands_refuse_an_output_dir_of_other_files_before_any_work(tmp_path: Path, command: list[str]):
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("keep me")
    proc = dgpipe(*command, str(kept), timeout=300)
    assert proc.returncode == 2 and "exists and is not" in proc.stderr and "Traceback" not in proc.stderr
    assert (kept / "notes.txt").read_text() == "keep me" and [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_only_what_dgpipe_wrote_is_an_earlier_output(tmp_path: Path):
    """A marker any Hugging Face checkpoint or Triton repository has would let `--output` replace one: a
    quantized checkpoint is one whose dgpipe.json records its quantization, a model repository one holding
    dgpipe models only (each version with its checkpoint)."""
    from pipeline.atomic import check_replaceable, json_key
    from pipeline.serving.repository import REPOSITORY_KIND, _only_dgpipe_models

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    quantized = json_key("dgpipe.json", "quantization")
    with pytest.raises(DgpipeError, match="exists and is not"):
        check_replaceable(hf, "a checkpoint dgpipe quantize wrote", quantized)
    (hf / "dgpipe.json").write_text('{"quantization": {"precision": "fp8"}}')
    check_replaceable(hf, "a checkpoint dgpipe quantize wrote", quantized)
    repo = tmp_path / "repo"
    (repo / "dgpipe" / "1" / "checkpoint").mkdir(parents=True)
    (repo / "dgpipe" / "1" / "checkpoint" / "config.json").write_text("{}")
    check_replaceable(repo, REPOSITORY_KIND, _only_dgpipe_models)
    (repo / "other" / "1").mkdir(parents=True)  # a model of someone else's beside it
    (repo / "other" / "config.pbtxt").write_text('name: "other"\n')
    with pytest.raises(DgpipeError, match="exists and is not a model repository dgpipe package wrote"):
        check_replaceable(repo, REPOSITORY_KIND, _only_dgpipe_models)


class _WriterError(
    Exception
):  # a writer's own error type for a file system refusal (safetensors' SafetensorError)
    pass


def test_a_full_disk_reported_by_a_writer_is_an_os_error_and_leaves_nothing(tmp_path: Path):
    """safetensors reports ENOSPC as "I/O error: No space left on device (os error 28)" in an error of its
    own type, which the CLI's error table does not know: it is raised as the OSError it is, naming the
    output, so the command ends with one line and exit 2."""
    out = tmp_path / "ckpt"
    with pytest.raises(OSError) as e, atomic_dir(out, "a checkpoint", "*.safetensors"):
        raise _WriterError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert e.value.errno == 28 and e.value.filename == str(out)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_unwinds_an_atomic_write_under_the_cli(tmp_path: Path):
    """SIGTERM (a pod deleted, a CI job cancelled, `timeout`) ends a command as Ctrl-C does: the temp dir of
    the write it cut short is removed, not left on the PVC."""
    import os
    import signal

    from pipeline.cli.errors import terminate_like_interrupt

    before = signal.getsignal(signal.SIGTERM)
    terminate_like_interrupt()
    try:
        with (
            pytest.raises(KeyboardInterrupt),
            atomic_dir(tmp_path / "onnx", "an ONNX export", "*.onnx") as tmp,
        ):
            (tmp / "model.onnx").write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
        # the first signal unwinds; a second one would end the process at once
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert list(tmp_path.iterdir()) == []


def test_an_input_error_of_a_writer_is_not_blamed_on_the_output(tmp_path: Path):
    """Only the file system's refusals to write (no space, no quota, read-only, I/O) name the output: a
    Rust reader's "No such file or directory (os error 2)" for its input stays the error it is."""
    with pytest.raises(_WriterError), atomic_dir(tmp_path / "ckpt", "a checkpoint", "*.safetensors"):
        raise _WriterError("No such file or directory (os error 2)")
    assert list(tmp_path.iterdir()) == []
