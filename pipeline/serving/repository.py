"""`dgpipe package`: write a Triton model repository that serves a checkpoint.

config.pbtxt is built from Triton's own protobuf schema (`model_config_pb2`) and printed with
`text_format`, so every field is type-checked and there are no template placeholders to leave unfilled.
Its tensors come from pipeline/serving/schema.py, which the Triton model and the clients read too.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.atomic import atomic_dir
from pipeline.builddir import (
    LAYOUT,
    MODEL_CHECKPOINT,
    MODEL_NAME,
    TRITON_MODEL_FILE,
    holding_build_dir,
    model_version_dir,
    record_stage,
    target_engine_dir,
)
from pipeline.devices import check_device
from pipeline.endpoints import check_model_name
from pipeline.errors import DgpipeError
from pipeline.limits import Limits, flag
from pipeline.model.files import checkpoint_files
from pipeline.model.validate import validate_checkpoint
from pipeline.resources import TRITON_MODEL_SOURCE
from pipeline.serving import schema
from pipeline.stages import StageResult

REPOSITORY_KIND = "a model repository dgpipe package wrote"


def _only_dgpipe_models(repo: Path) -> bool:
    """What an --output dir may hold for a package to replace it: dgpipe models only (each a model dir whose
    version holds the model's checkpoint), never a repository that also serves other models."""
    return all(any(entry.glob(f"*/{MODEL_CHECKPOINT}/config.json")) for entry in repo.iterdir())


def model_config(
    name: str,
    limits: Limits,
    device: str,
    warmup: dict[str, Any] | None,
    compile: bool = False,
):
    """The ModelConfig protobuf: decoupled Python backend, the schema's tensors, parameters (the limits,
    under their own names, read by the Triton model into schema.ServerLimits; `max_prompt` already within
    what the model's positions hold) and a warm-up request (`warmup`: input name -> value, written by
    `package` under warmup/)."""
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for t in schema.INPUTS:
        cfg.input.append(
            mc.ModelInput(
                name=t.name, data_type=mc.DataType.Value(t.config_type), dims=t.dims, optional=t.optional
            )
        )
    for t in schema.OUTPUTS:
        cfg.output.append(
            mc.ModelOutput(name=t.name, data_type=mc.DataType.Value(t.config_type), dims=t.dims)
        )
    # one instance that places its tensors itself (device "auto" = the first GPU if there is one): it owns
    # the runtime, and concurrency comes from shared denoise passes, not from copies of the model
    cfg.instance_group.append(mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1))
    for key, value in {
        "checkpoint": MODEL_CHECKPOINT,
        **{k: str(v) for k, v in limits.model_dump().items() if k != "max_context"},
        "device": device,
        "compile": str(
            compile
        ).lower(),  # the PyTorch path's passes through torch.compile (runtime/compiled.py)
    }.items():
        cfg.parameters[key].string_value = value
    if warmup is not None:
        warm = mc.ModelWarmup(name="first_canvas", batch_size=1)
        for n in warmup:
            t = schema.INPUT[n]
            warm.inputs[n].CopyFrom(
                mc.ModelWarmup.Input(data_type=mc.DataType.Value(t.config_type), dims=[1], input_data_file=n)
            )
        cfg.model_warmup.append(warm)
    return cfg


def package(
    model: Path,
    output: Path,
    name: str = MODEL_NAME,
    limits: Limits | None = None,
    device: str = "auto",
    engines: Path | None = None,
    compile: bool = False,
    engine_limits: Limits | None = None,
) -> Path:
    """`engines`: a directory of `<target>/{model.plan,engine.json}` (a build's `engines/`), copied into the
    model version so the Triton model runs the plan that matches its GPU (pipeline/engine/select.py).
    `engine_limits`: the caps a build's engines were built for, which `limits` must fit.
    The prompt limit written is at most what the model's positions hold with one canvas after the prompt."""
    from google.protobuf import text_format

    check_device(device)  # written into config.pbtxt: a wrong one would fail only when Triton loads the model

    check_model_name(name)
    limits = limits or Limits()
    # refuse a broken checkpoint (or generation defaults past the caps) before writing anything
    ckpt = validate_checkpoint(model, weights=True, limits=limits)
    engine_dirs = _engine_dirs(engines) if engines is not None else []
    if engine_limits is not None:
        check_fits_engine(limits, engine_limits, ckpt.config.canvas_length)
    text = ckpt.config.text_config
    prompt_cap = schema.prompt_limit(
        limits.max_prompt, text.max_position_embeddings, ckpt.config.canvas_length
    )
    if prompt_cap < 1:
        raise DgpipeError(
            f"the model's {text.max_position_embeddings} positions leave no room for a prompt and one "
            f"{ckpt.config.canvas_length}-token canvas"
        )
    warmup = _warmup_request(ckpt)
    cfg = model_config(name, limits.merged(max_prompt=prompt_cap), device, warmup, compile)
    with atomic_dir(output, REPOSITORY_KIND, _only_dgpipe_models) as tmp:
        mdir = tmp / name
        version = model_version_dir(tmp, name)
        version.mkdir(parents=True)
        (mdir / "config.pbtxt").write_text(text_format.MessageToString(cfg))
        shutil.copy(TRITON_MODEL_SOURCE, version / TRITON_MODEL_FILE)
        copy_checkpoint(ckpt.path, version / MODEL_CHECKPOINT)
        for d in engine_dirs:
            shutil.copytree(d, target_engine_dir(version, d.name), ignore=shutil.ignore_patterns(".*"))
        if warmup is not None:
            (mdir / "warmup").mkdir()
            for n, value in warmup.items():
                (mdir / "warmup" / n).write_bytes(schema.raw_bytes(n, value))
    return output


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy the checkpoint's regular files only, each from inside the checkpoint (checkpoint_files has
    refused symlinks out, devices, FIFOs and pickle files); contents are copied, never links."""
    for rel in checkpoint_files(src):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst / rel)


@holding_build_dir
def package_stage(
    build_dir: Path,
    overrides: dict[str, int | None] | None = None,
    *,
    device: str = "auto",
    compile: bool = False,
) -> StageResult:
    """The package stage of `dgpipe build` and `dgpipe package --build-dir`: the build's checkpoint (and the
    engines built here, if any) into its model repository, recorded in the build manifest with its limits.
    The limits are those the build recorded as data (the engine caps of its engine stage, the serving caps
    of an earlier package stage), with `overrides` (the CLI's) on top, so both commands write the same
    config.pbtxt for the same build dir. Its details say whether engines were shipped."""
    start = time.perf_counter()
    from pipeline.builddir import load_manifest
    from pipeline.engine.stage import recorded_limits

    build_dir = Path(build_dir)
    manifest = load_manifest(build_dir)
    recorded = recorded_limits(manifest)
    limits = recorded.merged(**(overrides or {}))
    checkpoint = build_dir / LAYOUT["checkpoint"]
    engines = build_dir / LAYOUT["engines"]
    built = engines if any(engines.glob("*/model.plan")) else None
    repo = package(
        checkpoint,
        build_dir / LAYOUT["model_repository"],
        name=manifest.model_name,
        limits=limits,
        engine_limits=recorded,
        engines=built,
        device=device,
        compile=compile,
    )
    record_stage(
        build_dir,
        "package",
        {"model_repository": repo},
        inputs={"checkpoint": checkpoint, **({"engines": built} if built else {})},
        details={
            "engines": built is not None,
            "model_name": manifest.model_name,
            "limits": limits.model_dump(),
            "device": device,
            "compile": compile,
        },
    )
    where = "with the engines built here" if built else "engines are added on the target node"
    line = f"model repository: {repo} (model '{manifest.model_name}'; {where})"
    details = {"model_repository": str(repo), "engines": built is not None}
    return StageResult("package", {"model_repository": repo}, time.perf_counter() - start, [line], details)


def check_fits_engine(limits: Limits, engine: Limits, canvas: int) -> None:
    """A build's repository admits no request its engines cannot run: engine caps at most those the plans
    were built for, and the longest prompt plus max_tokens within their context."""
    for key in Limits.ENGINE_FIELDS:
        if getattr(limits, key) > getattr(engine, key):
            raise DgpipeError(
                f"{flag(key)} {getattr(limits, key)}: the build's engines were built for "
                f"{getattr(engine, key)}",
                f"drop the option, or rebuild the engines with {flag(key)} {getattr(limits, key)}",
            )
    limits.check_fits(canvas)


def _engine_dirs(engines: Path) -> list[Path]:
    """The engine dirs to ship, each with a readable manifest and its plan; refused before writing anything."""
    from pipeline.engine.plan_record import load_engine_manifest
    from pipeline.engine.select import engine_dirs

    dirs = engine_dirs(Path(engines))
    if not dirs:
        raise DgpipeError(
            f"--engines {engines}: no engines/<target>/engine.json", "run `dgpipe engine build` first"
        )
    for d in dirs:
        m = load_engine_manifest(d)
        if not (d / m.plan).is_file():
            raise DgpipeError(f"{d}: engine.json names {m.plan}, which is missing")
    return dirs


def _warmup_request(ckpt) -> dict[str, Any]:
    """The warm-up request's inputs: the checkpoint's example prompt and one canvas of tokens."""
    from pipeline.runtime.prompt_format import prompt_format_for

    prompt = prompt_format_for(ckpt, tokenizer=None).example_prompt
    return {"text_input": prompt, "max_tokens": ckpt.config.canvas_length}
