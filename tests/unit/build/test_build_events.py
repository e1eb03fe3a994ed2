"""The build's events, resume fingerprints, summary table and the capture of third-party output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.build import resume
from pipeline.build.events import PhaseProgress, StageFinished, StageProgress
from pipeline.build.summary import Row, human_size, next_command, render, tree_size
from pipeline.builddir import BuildManifest, record_stage
from pipeline.cli.build_view import JsonView
from pipeline.cli.capture import capture


def test_phase_progress_eta_is_the_rate_so_far_times_what_is_left():
    now = [100.0]
    seen: list[StageProgress] = []
    prog = PhaseProgress(seen.append, "quantize", "calibration", 10, clock=lambda: now[0])
    now[0] = 104.0
    prog.advance(2)  # 2 s per step, 8 left
    now[0] = 110.0
    prog.advance(1, phase="calibration (pass 2)")  # 10 s / 3 steps, 7 left
    assert [(e.done, e.eta) for e in seen] == [(0, None), (2, 16.0), (3, 23.3)]
    assert seen[-1].phase == "calibration (pass 2)" and seen[-1].total == 10


def test_events_stream_as_json_lines_with_their_kind(tmp_path: Path):
    f = (tmp_path / "events").open("w")
    view = JsonView(f)
    view(StageFinished("export", 1.5, "/b/onnx", 2048, "onnx.checker passed", ["wrote it"], {"opset": 21}))
    view(StageProgress("quantize", "calibration", 3, 40, 12.5))
    f.close()
    lines = [json.loads(x) for x in (tmp_path / "events").read_text().splitlines()]
    assert lines[0] == {
        "event": "stage_finished",
        "stage": "export",
        "seconds": 1.5,
        "output": "/b/onnx",
        "size": 2048,
        "gate": "onnx.checker passed",
        "lines": ["wrote it"],
        "details": {"opset": 21},
    }
    assert lines[1] == {
        "event": "progress",
        "stage": "quantize",
        "phase": "calibration",
        "done": 3,
        "total": 40,
        "eta": 12.5,
    }


def test_fingerprint_changes_with_any_input_and_with_the_stage_before():
    base = resume.fingerprint("quantize", {"precision": "fp8", "calib_size": 8}, None)
    assert base == resume.fingerprint("quantize", {"calib_size": 8, "precision": "fp8"}, None)  # key order
    assert base != resume.fingerprint("quantize", {"precision": "fp8", "calib_size": 9}, None)
    assert base != resume.fingerprint("export", {"precision": "fp8", "calib_size": 8}, None)
    assert resume.fingerprint("export", {}, base) != resume.fingerprint("export", {}, "other")


def test_a_stage_is_skipped_only_with_its_fingerprint_and_its_output(tmp_path: Path):
    build = tmp_path / "build"
    (build / "onnx").mkdir(parents=True)
    man = BuildManifest(model="m", precision="fp8", targets=["sm90"])
    man = record_stage(build, "export", {"onnx": build / "onnx"}, manifest=man)
    assert (
        resume.finished(man, build, "export", "fp1", "onnx") is None
    )  # never marked: a lone `dgpipe export`
    (build / "onnx" / "model.onnx").write_bytes(b"graph")
    man = resume.mark(build, "export", "fp1", 2.5, "onnx")
    rec = resume.finished(man, build, "export", "fp1", "onnx")
    assert rec is not None and rec.details["build_seconds"] == 2.5 and rec.outputs == {"onnx": "onnx"}
    assert resume.finished(man, build, "export", "fp2", "onnx") is None  # inputs changed
    (build / "onnx" / ".trt.x.onnx").write_bytes(b"lowered")  # the engine stage's, beside it for a while
    assert resume.finished(man, build, "export", "fp1", "onnx") is not None
    # another command wrote over the output since (`dgpipe export --output BUILD/onnx`): the stage runs again
    (build / "onnx" / "model.onnx").write_bytes(b"another graph")
    assert resume.finished(man, build, "export", "fp1", "onnx") is None
    man = resume.mark(build, "export", "fp1", 2.5, "onnx")
    assert resume.finished(man, build, "export", "fp1", "onnx") is not None
    shutil.rmtree(build / "onnx")
    assert resume.finished(man, build, "export", "fp1", "onnx") is None  # output gone


def test_file_digest_follows_the_content(tmp_path: Path):
    f = tmp_path / "calib.jsonl"
    f.write_text('{"text": "a"}\n')
    first = resume.file_digest(f)
    f.write_text('{"text": "b"}\n')
    assert resume.file_digest(f) != first and resume.file_digest(None) is None


def test_summary_table_lists_stages_engines_and_the_next_command(tmp_path: Path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"x" * 3000)
    (tmp_path / "d" / "b.bin").write_bytes(b"y" * 72)
    assert tree_size(tmp_path / "d") == 3072 and human_size(3072) == "3.0 KiB" and human_size(5) == "5 B"
    engines = {
        "sm90": {"status": "deferred", "reason": "no GPU", "command": "dgpipe engine build --target sm90"}
    }
    nxt = next_command(tmp_path, engines)
    assert nxt.startswith(f"dgpipe serve --repo {tmp_path / 'model_repository'}") and "manifests" in nxt
    rows = [
        Row("quantize", "skipped", 7.25, "checkpoint", 1_800_000, "accuracy: run x"),
        Row("export", "ran", 1.0, "onnx", 2048, "onnx.checker passed"),
    ]
    lines = render(rows, engines, nxt, 9.5)
    assert lines[0].split() == ["stage", "status", "seconds", "output", "size", "gate"]
    assert lines[1].split()[:5] == ["quantize", "skipped", "7.2", "checkpoint", "1.7"]
    assert lines[2].split() == ["export", "ran", "1.0", "onnx", "2.0", "KiB", "onnx.checker", "passed"]
    assert lines[3] == "engine sm90: deferred to the target node (no GPU): dgpipe engine build --target sm90"
    assert lines[4] == f"build finished in 9.5s; next: {nxt}"


CHILD = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from pipeline.cli.capture import capture

log = Path(sys.argv[1])
with capture(log, echo=lambda line: sys.__stderr__.write("echo: " + line + "\\n")) as cap:
    print("a print")
    warnings.warn("a warning", UserWarning, stacklevel=1)
    logging.getLogger("some.lib").warning("a log record")
    os.write(2, b"a write to fd 2\\n")
    subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
    log.parent.mkdir()  # the log appears once its directory does; earlier lines are kept
    print("after mkdir")
    cap.stdout.write("ours\\n")
print("restored", cap.lines)
"""


def test_capture_sends_every_kind_of_third_party_output_to_the_log(tmp_path: Path):
    """In a child process, as `dgpipe build` runs: pytest would otherwise take the warnings and records."""
    log = tmp_path / "build" / "build.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(log)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    text = log.read_text()
    third_party = (
        "a print",
        "a warning",
        "a log record",
        "a write to fd 2",
        "a child process",
        "after mkdir",
    )
    for line in third_party:
        assert line in text and any(e.startswith("echo: ") and line in e for e in proc.stderr.splitlines())
    assert "ours" not in text and proc.stdout.splitlines()[0] == "ours"
    # the count is the log's lines of this run (the header aside); the descriptors are restored after
    assert proc.stdout.splitlines()[1] == f"restored {len(text.splitlines()) - 1}"


def test_capture_leaves_no_file_when_the_directory_never_appears(tmp_path: Path):
    with capture(tmp_path / "nowhere" / "build.log") as cap:
        pass
    assert cap.lines == 0 and not (tmp_path / "nowhere").exists()


def test_the_live_bar_of_a_phase_of_unknown_length_shows_no_count_left_from_the_phase_before():
    """rich keeps a task's total once set; a phase with no count (an import, nvcc) gets a fresh bar."""
    import io

    from rich.console import Console

    from pipeline.cli.build_view import ConsoleView

    view = ConsoleView(io.StringIO())
    view.console = Console(file=io.StringIO(), force_terminal=True, width=120)
    view.live = True
    view(StageProgress("quantize", "import modelopt", 2, 3, 0.0))
    assert view.bars.tasks[0].total == 3
    view(StageProgress("quantize", "load model", 0, None, None))
    task = view.bars.tasks[0]
    assert len(view.bars.tasks) == 1 and task.total is None and task.description == "quantize: load model"
    view.close()
