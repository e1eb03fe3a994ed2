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
    EngineLimits,
    model_version_dir,
    record_stage,
    target_engine_dir,
)
from pipeline.errors import DgpipeError
from pipeline.model.validate import checkpoint_files, validate_checkpoint
from pipeline.resources import TRITON_MODEL_SOURCE
from pipeline.serving import schema
from pipeline.stages import StageResult


def model_config(
    name: str,
    max_batch: int,
    max_tokens_limit: int,
    max_prompt_tokens: int,
    device: str,
    warmup: dict[str, Any] | None,
    max_steps_limit: int = EngineLimits.max_steps,
    request_seconds_limit: int = EngineLimits.max_request_seconds,
    compile: bool = False,
):
    """The ModelConfig protobuf: decoupled Python backend, the schema's tensors, parameters (the caps a
    request may ask for, read by the Triton model into schema.ServerLimits) and a warm-up request (`warmup`:
    input name -> value, written by `package` under warmup/)."""
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
        "max_batch": str(max_batch),
        "max_tokens_limit": str(max_tokens_limit),
        "max_prompt_tokens": str(max_prompt_tokens),
        "max_denoising_steps_limit": str(max_steps_limit),
        "max_request_seconds": str(request_seconds_limit),
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
    max_batch: int = EngineLimits.max_batch,
    max_tokens_limit: int = EngineLimits.max_tokens,
    max_prompt_tokens: int = EngineLimits.max_prompt,
    device: str = "auto",
    engines: Path | None = None,
    max_steps_limit: int = EngineLimits.max_steps,
    request_seconds_limit: int = EngineLimits.max_request_seconds,
    compile: bool = False,
) -> Path:
    """`engines`: a directory of `<target>/{model.plan,engine.json}` (a build's `engines/`), copied into the
    model version so the Triton model runs the plan that matches its GPU (pipeline/engine/select.py).
    The prompt limit written is at most what the model's positions hold with one canvas after the prompt."""
    from google.protobuf import text_format

    ckpt = validate_checkpoint(model, weights=True)  # refuse a broken checkpoint before writing anything
    engine_dirs = _engine_dirs(engines) if engines is not None else []
    if min(max_batch, max_tokens_limit, max_prompt_tokens, max_steps_limit, request_seconds_limit) < 1:
        raise DgpipeError(
            "--max-batch, --max-tokens-limit, --max-prompt-tokens and --request-timeout must be >= 1"
        )
    if max(max_tokens_limit, max_prompt_tokens, max_steps_limit, request_seconds_limit) > schema.INT32_MAX:
        raise DgpipeError(f"--max-tokens-limit and --max-prompt-tokens must be <= {schema.INT32_MAX}")
    text = ckpt.config.text_config
    prompt_cap = schema.prompt_limit(
        max_prompt_tokens, text.max_position_embeddings, ckpt.config.canvas_length
    )
    if prompt_cap < 1:
        raise DgpipeError(
            f"the model's {text.max_position_embeddings} positions leave no room for a prompt and one "
            f"{ckpt.config.canvas_length}-token canvas"
        )
    warmup = _warmup_request(ckpt)
    cfg = model_config(
        name,
        max_batch,
        max_tokens_limit,
        prompt_cap,
        device,
        warmup,
        max_steps_limit,
        request_seconds_limit,
        compile,
    )
    with atomic_dir(output) as tmp:
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


def package_stage(build_dir: Path, limits: EngineLimits) -> StageResult:
    """The package stage of `dgpipe build`: the build's checkpoint (and the engines built here, if any) into
    its model repository, recorded in the build manifest. Its details say whether engines were shipped."""
    start = time.perf_counter()
    checkpoint = build_dir / LAYOUT["checkpoint"]
    engines = build_dir / LAYOUT["engines"]
    built = engines if any(engines.glob("*/model.plan")) else None
    repo = package(
        checkpoint,
        build_dir / LAYOUT["model_repository"],
        max_batch=limits.max_batch,
        max_prompt_tokens=limits.max_prompt,
        max_tokens_limit=limits.max_tokens,
        engines=built,
        max_steps_limit=limits.max_steps,
        request_seconds_limit=limits.max_request_seconds,
    )
    record_stage(
        build_dir,
        "package",
        {"model_repository": repo},
        inputs={"checkpoint": checkpoint, **({"engines": built} if built else {})},
        details={"engines": built is not None},
    )
    where = "with the engines built here" if built else "engines are added on the target node"
    line = f"model repository: {repo} (model '{MODEL_NAME}'; {where})"
    details = {"model_repository": str(repo), "engines": built is not None}
    return StageResult("package", {"model_repository": repo}, time.perf_counter() - start, [line], details)


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
