"""`dgpipe build` on a CPU machine: every stage up to the engine, the node step for the engine, a
repository that serves the quantized checkpoint, and refusals before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests._utils.cli import DGPIPE, ROOT, dgpipe

pytest.importorskip("modelopt", reason="nvidia-modelopt is not installed (pip install dgpipe[quantize])")
pytest.importorskip("onnxruntime", reason="onnx/onnxruntime are not installed (pip install dgpipe[engine])")

from pipeline.sampler.kernels.build import find_nvcc

ARGS = ("--precision", "fp8", "--target", "sm90,sm100", "--calib-size", "8")


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _finished(events: list[dict]) -> dict:
    return next(e for e in events if e["event"] == "build_finished")


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> dict:
    """One build for the module, interrupted once: SIGINT as soon as the export stage starts (quantize has
    finished and is recorded), then the same command again, which resumes; then a text-mode re-run."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found: the sampler PTX cannot be compiled")
    build = tmp_path_factory.mktemp("build") / "build"
    argv = [*DGPIPE, "build", *ARGS, "--build-dir", str(build), "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # SIGINT as a terminal delivers it: a test worker process (pytest-xdist) may run with SIGINT ignored,
    # which a child inherits
    first = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    interrupted = []
    for line in first.stdout:
        interrupted.append(json.loads(line))
        if interrupted[-1].get("event") == "stage_started" and interrupted[-1]["stage"] == "export":
            first.send_signal(signal.SIGINT)
    first.wait(timeout=120)
    resumed = dgpipe("build", *ARGS, "--build-dir", str(build), "--json")
    again = dgpipe("build", *ARGS, "--build-dir", str(build))
    return {
        "dir": build,
        "interrupted": (first.returncode, interrupted, first.stderr.read()),
        "resumed": resumed,
        "again": again,
    }


def test_fp8_build_writes_every_stage_and_defers_the_engine(build):
    proc = build["resumed"]
    build = build["dir"]
    assert proc.returncode == 0, proc.stderr
    summary = _finished(_events(proc.stdout))["summary"]
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
    # the graph TensorRT builds from is bf16 (the FP8 expert plugins take bf16 hidden states), and the
    # engine stage accepts it for an fp8 engine
    assert man["stages"]["export"]["details"]["model_dtype"] == "BFLOAT16"
    for t in ("sm90", "sm100"):
        ptx = (build / "plugins" / t / "dg_sampler.ptx").read_text()
        assert f".target sm_{t[2:]}a" in ptx
        rec = man["stages"]["engine"]["details"]["engines"][t]
        assert rec["status"] == "deferred" and "TensorRT" in rec["reason"]
        assert rec["command"][rec["command"].index("--output") + 1] == "model_repository/dgpipe/1"
    # the engine stage's lines say what happens on the target
    assert any(
        "built on the target node" in line for e in _events(proc.stdout) for line in e.get("lines", [])
    )
    version = build / "model_repository" / "dgpipe" / "1"
    assert (version / "checkpoint" / "hf_quant_config.json").is_file() and (version / "model.py").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "nvfp4", "--target", "sm90"], "use --precision fp8 for sm90"),
        (["--precision", "fp6"], "unknown precision 'fp6'"),
        (["--precision", "fp8", "--target", "sm75"], "unknown GPU target 'sm75'"),
        (["--precision", "fp8", "--model", "/nonexistent"], "no such checkpoint directory"),
        (["--precision", "fp8", "--name", "../chat"], "'../chat' is not a valid model name"),
        (
            ["--precision", "fp8", "--calib-data", "/nonexistent.jsonl"],
            "--calib-data /nonexistent.jsonl: no such file",
        ),
        (["--precision", "fp8", "--calib-size", "0"], "--calib-size must be >= 1"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path, args, message):
    proc = dgpipe("build", *args, "--build-dir", str(tmp_path / "build"))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "build").exists()


def test_a_failed_build_says_why_in_its_json_events(tmp_path: Path):
    """A script reading `--json` learns why a build stopped from the events alone: the last line."""
    proc = dgpipe("build", "--precision", "fp6", "--build-dir", str(tmp_path / "build"), "--json")
    events = _events(proc.stdout)
    assert proc.returncode == 2 and events[0]["event"] == "stage_started"
    assert events[-1] == {"event": "build_failed", "error": "unknown precision 'fp6' (choose one of: "
                          "bf16, fp8, int4_awq, nvfp4)", "exit_code": 2}  # fmt: skip
    assert "unknown precision 'fp6'" in proc.stderr


def test_an_interrupted_build_resumes_from_the_last_finished_stage(build):
    code, events, stderr = build["interrupted"]
    assert code == 130 and "Traceback" not in stderr and events[-1]["event"] == "interrupted"
    assert [e["stage"] for e in events if e["event"] == "stage_finished"] == ["validate", "quantize"]
    resumed = _events(build["resumed"].stdout)
    assert [e["stage"] for e in resumed if e["event"] == "stage_skipped"] == ["quantize"]
    finished = [e["stage"] for e in resumed if e["event"] == "stage_finished"]
    assert finished == ["validate", "export", "engine", "package"]
    man = json.loads((build["dir"] / "build_manifest.json").read_text())
    assert all(len(rec["fingerprint"]) == 64 for rec in man["stages"].values())


def test_the_json_stream_announces_each_stage_and_shows_progress_with_an_eta(build):
    events = _events(build["resumed"].stdout)
    assert events[0] == {"event": "stage_started", "stage": "validate", "what": events[0]["what"]}
    export = [e for e in events if e["event"] == "progress" and e["stage"] == "export"]
    assert export[0]["phase"] == "read checkpoint" and export[0]["done"] == 0 and export[0]["eta"] is None
    # the FP8 checkpoint streams into the graph (its packed weights copied from the shards), counted in MiB
    copies = [e for e in export if e["phase"] == "copy weights (MiB)"]
    assert copies and copies[-1]["done"] == copies[-1]["total"] >= 1 and copies[-1]["eta"] is not None
    rows = _finished(events)["rows"]
    assert [(r["stage"], r["status"]) for r in rows] == [
        ("validate", "ran"),
        ("quantize", "skipped"),
        ("export", "ran"),
        ("engine", "ran"),
        ("package", "ran"),
    ]
    assert _finished(events)["engines"]["sm90"]["status"] == "deferred"
    assert _finished(events)["next_command"].startswith("dgpipe serve --repo ")


def test_the_console_shows_the_stages_and_the_summary_and_no_third_party_line(build):
    proc = build["again"]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    skips = [x.split()[2] for x in out if " skip " in x]
    assert skips == ["quantize:", "export:", "engine:", "package:"]  # nothing changed: every stage skipped
    table = out[out.index(next(x for x in out if x.startswith("stage "))) :]
    assert [row.split()[:2] for row in table[1:6]] == [
        ["validate", "ran"],
        ["quantize", "skipped"],
        ["export", "skipped"],
        ["engine", "skipped"],
        ["package", "skipped"],
    ]
    assert table[6].startswith("engine sm90: deferred to the target node")
    # runnable from anywhere: the recorded command's paths are the build dir's
    assert f"cd {build['dir'].resolve()} && dgpipe engine build --onnx onnx/model.onnx" in table[6]
    assert "next: dgpipe serve --repo" in table[8]
    log = (build["dir"] / "build.log").read_text()
    assert "Tied weight (declared)" in log  # ModelOpt's export lines went to the log, not the console
    assert "Tied weight" not in proc.stdout + proc.stderr and "Warning" not in proc.stdout + proc.stderr


def test_a_named_build_serves_under_its_name_and_keeps_the_quantized_stages(build, tmp_path):
    """`--name` on a finished build: quantize and export are kept, the engine step for the node and the
    repository follow the new name, and nothing is left under the old one."""
    import shutil

    named = tmp_path / "build"
    shutil.copytree(build["dir"], named)
    proc = dgpipe("build", *ARGS, "--build-dir", str(named), "--name", "tiny-chat", "--json")
    assert proc.returncode == 0, proc.stderr
    events = _events(proc.stdout)
    assert [e["stage"] for e in events if e["event"] == "stage_skipped"] == ["quantize", "export"]
    man = json.loads((named / "build_manifest.json").read_text())
    assert man["model_name"] == "tiny-chat"
    rec = man["stages"]["engine"]["details"]["engines"]["sm90"]
    assert rec["command"][rec["command"].index("--output") + 1] == "model_repository/tiny-chat/1"
    assert sorted(p.name for p in (named / "model_repository").iterdir()) == ["tiny-chat"]
    assert 'name: "tiny-chat"' in (named / "model_repository" / "tiny-chat" / "config.pbtxt").read_text()


def test_bf16_build_streams_the_float_checkpoint_into_a_bf16_graph(tmp_path):
    """A float checkpoint is copied into the graph tensor by tensor (the 26B in bf16 would otherwise be loaded
    whole: ~52 GB of host memory), with its progress in MiB, and the graph is the bf16 one TensorRT builds a
    bf16 engine from."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found: the sampler PTX cannot be compiled")
    build = tmp_path / "build"
    r = dgpipe("build", "--precision", "bf16", "--target", "sm90", "--build-dir", str(build), "--json")
    assert r.returncode == 0, r.stderr
    copies = [e for e in _events(r.stdout) if e.get("phase") == "copy weights (MiB)"]
    assert (
        copies
        and copies[-1]["done"]
        == copies[-1]["total"]
        == (build / "checkpoint" / "model.safetensors").stat().st_size >> 20
    )
    assert [e["done"] for e in copies] == sorted({e["done"] for e in copies})  # one event per MiB gained
    export = json.loads((build / "build_manifest.json").read_text())["stages"]["export"]["details"]
    assert export["model_dtype"] == "BFLOAT16"
    rec = _finished(_events(r.stdout))["summary"]["engine"]["engines"]["sm90"]
    assert rec["status"] == "deferred" and "--precision" in rec["command"] and "bf16" in rec["command"]
