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


def test_the_served_runtime_takes_the_repositorys_batch_and_limits(tiny_checkpoint: Path, tmp_path: Path):
    """The Triton model's loader builds its runtime with the batch `package --max-batch` wrote: a TensorRT
    plan takes no more rows than its profiles, and an operator lowers the batch to fit memory."""
    import json

    from google.protobuf import json_format

    from pipeline.builddir import model_version_dir
    from pipeline.serving.core.loading import Log, load_model

    repo = package(tiny_checkpoint, tmp_path / "repo", limits=Limits(max_batch=3, max_tokens=300))
    cfg = text_format.Parse((repo / "dgpipe" / "config.pbtxt").read_text(), mc.ModelConfig())
    # what Triton hands the Python backend: the model config as JSON, with the proto's field names
    config = json.loads(json_format.MessageToJson(cfg, preserving_proto_field_name=True))
    loaded = load_model(config, model_version_dir(repo), Log(info=lambda m: None, error=lambda m: None))
    assert loaded.runtime.max_batch == loaded.limits.max_batch == 3
    assert loaded.limits.max_tokens == 300


def test_compile_is_a_model_parameter(tiny_checkpoint: Path, tmp_path: Path, monkeypatch):
    """`package --compile` sets the parameter the Triton model reads to compile its passes at load: the
    serving core's loader (which model.py calls) opens the session with it, and without it does not."""
    from google.protobuf import json_format

    from pipeline.builddir import model_version_dir
    from pipeline.runtime import session
    from pipeline.serving.core.loading import Log, load_model

    class Opened(Exception):
        pass

    def load_session(*args, compile=False, **kwargs):
        raise Opened(compile)

    monkeypatch.setattr(session, "load_session", load_session)
    quiet = Log(info=lambda m: None, error=lambda m: None)
    for compiled in (True, False):
        repo = package(tiny_checkpoint, tmp_path / f"repo{compiled}", compile=compiled)
        cfg = text_format.Parse((repo / "dgpipe" / "config.pbtxt").read_text(), mc.ModelConfig())
        assert (cfg.parameters["compile"].string_value == "true") is compiled
        assert "load_model(" in (repo / "dgpipe" / "1" / "model.py").read_text()
        config = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
        with pytest.raises(Opened) as opened:
            load_model(config, model_version_dir(repo), quiet)
        assert opened.value.args == (compiled,)


def test_an_instance_triton_places_on_a_gpu_serves_on_that_gpu(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch
):
    """With `instance_group { kind: KIND_GPU }` each instance is a process of its own, told its GPU by the
    Python backend (`model_instance_kind` "GPU", `model_instance_device_id`): the plan is chosen for that GPU,
    the session opens there and a TensorRT plan runs there, where "auto" put every instance on GPU 0."""
    from types import SimpleNamespace

    import torch
    from google.protobuf import json_format

    from pipeline.builddir import model_version_dir
    from pipeline.engine import probe, trt_backend
    from pipeline.runtime import session
    from pipeline.serving.core.loading import Log, _backend, instance_count, load_model, serving_device

    assert serving_device("auto") == serving_device("auto", "CPU", "0") == "auto"
    assert serving_device("auto", "GPU", "3") == serving_device("cuda", "GPU", "3") == "cuda:3"
    assert serving_device("cuda:3", "GPU", "3") == "cuda:3"
    # the processes that split the host's threads: KIND_GPU without `gpus` is `count` on every visible GPU
    assert instance_count({"instance_group": [{"kind": "KIND_GPU", "count": 2}]}, visible_gpus=8) == 16
    assert instance_count({"instance_group": [{"kind": "KIND_GPU", "gpus": [0, 1]}]}, visible_gpus=8) == 2
    assert instance_count({"instance_group": [{"kind": "KIND_CPU", "count": 1}]}, visible_gpus=8) == 1
    for conflicting in ("cuda:1", "cpu"):
        with pytest.raises(DgpipeError, match=f"places this instance on GPU 3 .* is '{conflicting}'"):
            serving_device(conflicting, "GPU", "3")

    class Opened(Exception):
        pass

    def load_session(model, dtype, device, **kwargs):
        raise Opened(device)

    probed, made = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe, "gpu", lambda index=0: probed.append(index) or ("9.0", "NVIDIA H200"))
    monkeypatch.setattr(session, "load_session", load_session)
    quiet = Log(info=lambda m: None, error=lambda m: None)
    repo = package(tiny_checkpoint, tmp_path / "repo")
    cfg = text_format.Parse((repo / "dgpipe" / "config.pbtxt").read_text(), mc.ModelConfig())
    config = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
    with pytest.raises(Opened) as opened:
        load_model(config, model_version_dir(repo), quiet, "GPU", "3")
    assert opened.value.args == ("cuda:3",) and probed == [3]
    monkeypatch.setattr(
        trt_backend, "TensorRTBackend", lambda path, config, device: made.append(device) or "plan"
    )
    plan = SimpleNamespace(kind="tensorrt", engine_dir=tmp_path, reason="a plan for sm90")
    assert (
        _backend(plan, SimpleNamespace(model=SimpleNamespace(config=None)), quiet, torch.device("cuda:3"))
        == "plan"
    )
    assert made == ["cuda:3"]


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


def _build_dir(tiny_checkpoint: Path, tmp_path: Path, engine: Limits) -> Path:
    """A build dir as the stages before package leave it: its checkpoint, and the engine stage's record
    carrying the caps the engines were built for (as data)."""
    import shutil

    from pipeline.builddir import LAYOUT, BuildManifest, record_stage, save_manifest

    build = tmp_path / "build"
    shutil.copytree(tiny_checkpoint, build / LAYOUT["checkpoint"])
    save_manifest(build, BuildManifest(model="tiny", precision="bf16", targets=["sm90"]))
    values = engine.engine_values()
    record_stage(build, "engine", {}, details={"engines": {"sm90": {"limits": values}}, "limits": values})
    return build


def _params(repo: Path) -> dict[str, str]:
    from pipeline.builddir import MODEL_NAME

    cfg = text_format.Parse((repo / MODEL_NAME / "config.pbtxt").read_text(), mc.ModelConfig())
    return {k: v.string_value for k, v in cfg.parameters.items()}


def _cli(*args: str):
    from typer.testing import CliRunner

    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


def test_build_and_package_build_dir_write_the_same_limits(tiny_checkpoint: Path, tmp_path: Path):
    """`dgpipe build`'s package stage and a later `dgpipe package --build-dir` read the limits the build
    recorded as data: the same config.pbtxt limits, the engine caps those the engines were built for."""
    from pipeline.build import BuildOptions, _package
    from pipeline.builddir import LAYOUT, load_manifest

    engine = Limits(max_batch=3, max_prompt=40, max_context=1000, max_tokens=300, max_request_seconds=30)
    build = _build_dir(tiny_checkpoint, tmp_path, engine)
    opts = BuildOptions(model=tiny_checkpoint, precision="bf16", build_dir=build, limits=engine)
    _package(opts, build)
    by_build = _params(build / LAYOUT["model_repository"])
    assert load_manifest(build).stages["package"].details["limits"] == engine.model_dump()

    res = _cli("package", "--build-dir", str(build))
    assert res.exit_code == 0, res.output
    by_package = _params(build / LAYOUT["model_repository"])
    names = ("max_batch", "max_prompt", "max_tokens", "max_steps", "max_request_seconds")
    assert {k: by_package[k] for k in names} == {k: by_build[k] for k in names}
    assert (by_package["max_batch"], by_package["max_tokens"], by_package["max_request_seconds"]) == (
        "3",
        "300",
        "30",
    )


def test_package_build_dir_keeps_device_compile_and_given_limits(tiny_checkpoint: Path, tmp_path: Path):
    from pipeline.builddir import LAYOUT, load_manifest

    build = _build_dir(tiny_checkpoint, tmp_path, Limits(max_batch=4, max_prompt=40, max_context=400))
    res = _cli("package", "--build-dir", str(build), "--device", "cpu", "--compile", "--max-tokens", "200")
    assert res.exit_code == 0, res.output
    params = _params(build / LAYOUT["model_repository"])
    assert (params["device"], params["compile"]) == ("cpu", "true")
    assert (params["max_tokens"], params["max_batch"]) == ("200", "4")  # the CLI's, then the record's
    details = load_manifest(build).stages["package"].details
    assert (details["device"], details["compile"], details["limits"]["max_tokens"]) == ("cpu", True, 200)


def _user_error(monkeypatch, capsys, *args: str) -> str:
    """`dgpipe ARGS` through the console entry point (where errors are mapped): exit 2, one error line."""
    import sys

    from pipeline.cli import main

    monkeypatch.setattr(sys, "argv", ["dgpipe", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: "), (e.value.code, err)
    return err


def test_package_build_dir_refuses_limits_its_engines_cannot_run(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys
):
    build = _build_dir(tiny_checkpoint, tmp_path, Limits(max_batch=4, max_prompt=40, max_context=400))
    err = _user_error(monkeypatch, capsys, "package", "--build-dir", str(build), "--max-batch", "8")
    assert "--max-batch 8: the build's engines were built for 4" in err
    err = _user_error(monkeypatch, capsys, "package", "--build-dir", str(build), "--max-tokens", "400")
    assert "--max-tokens 400 after a 40-token prompt needs a" in err
    # the default max_tokens does not fit a 400-token context either: the hint names what does
    assert "use --max-tokens <=" in _user_error(monkeypatch, capsys, "package", "--build-dir", str(build))
    assert not (build / "model_repository").exists()


def test_package_refuses_generation_defaults_past_its_step_cap(tmp_path: Path):
    """The embedded model's generation_config asks for 48 denoise steps per canvas: a repository that caps
    requests at fewer would refuse the model's own default, so packaging it is refused, naming the cap."""
    from pipeline.resources import EMBEDDED_MODEL

    with pytest.raises(DgpipeError, match="max_denoising_steps 48 is over the serving cap of 16"):
        package(EMBEDDED_MODEL, tmp_path / "r", limits=Limits(max_steps=16))
    assert not (tmp_path / "r").exists()
    ok = _cli("package", "--model", str(EMBEDDED_MODEL), "--output", str(tmp_path / "r"), "--max-steps", "48")
    assert ok.exit_code == 0, ok.output
