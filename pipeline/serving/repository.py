"""`dgpipe package`: write a Triton model repository that serves a checkpoint.

config.pbtxt is built from Triton's own protobuf schema (`model_config_pb2`) and printed with
`text_format`, so every field is type-checked and there are no template placeholders to leave unfilled.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

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
from pipeline.model.checkpoint import open_checkpoint
from pipeline.resources import TRITON_MODEL_SOURCE

INPUTS = [  # name, type, dims, optional
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("stop_words", "TYPE_STRING", [-1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
    ("max_denoising_steps", "TYPE_INT32", [1], True),
    ("entropy_bound", "TYPE_FP32", [1], True),
    ("confidence_threshold", "TYPE_FP32", [1], True),
    ("t_min", "TYPE_FP32", [1], True),
    ("t_max", "TYPE_FP32", [1], True),
    ("stream_drafts", "TYPE_BOOL", [1], True),
    ("infill_template", "TYPE_STRING", [1], True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_INT32", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("denoise_steps", "TYPE_INT32", [-1]),
]


def model_config(
    name: str,
    max_batch: int,
    max_tokens_limit: int,
    max_prompt_tokens: int,
    device: str,
    warmup_prompt: str | None,
):
    """The ModelConfig protobuf: decoupled Python backend, our tensors, parameters and a warm-up request."""
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for n, t, dims, optional in INPUTS:
        cfg.input.append(mc.ModelInput(name=n, data_type=mc.DataType.Value(t), dims=dims, optional=optional))
    for n, t, dims in OUTPUTS:
        cfg.output.append(mc.ModelOutput(name=n, data_type=mc.DataType.Value(t), dims=dims))
    # one instance that places its tensors itself (device "auto" = the first GPU if there is one): it owns
    # the runtime, and concurrency comes from shared denoise passes, not from copies of the model
    cfg.instance_group.append(mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1))
    for key, value in {
        "checkpoint": MODEL_CHECKPOINT,
        "max_batch": str(max_batch),
        "max_tokens_limit": str(max_tokens_limit),
        "max_prompt_tokens": str(max_prompt_tokens),
        "device": device,
    }.items():
        cfg.parameters[key].string_value = value
    if warmup_prompt is not None:
        warm = mc.ModelWarmup(name="first_canvas", batch_size=1)
        warm.inputs["text_input"].CopyFrom(
            mc.ModelWarmup.Input(data_type=mc.TYPE_STRING, dims=[1], input_data_file="text_input")
        )
        warm.inputs["max_tokens"].CopyFrom(
            mc.ModelWarmup.Input(data_type=mc.TYPE_INT32, dims=[1], input_data_file="max_tokens")
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
) -> Path:
    """`engines`: a directory of `<target>/{model.plan,engine.json}` (a build's `engines/`), copied into the
    model version so the Triton model runs the plan that matches its GPU (pipeline/engine/select.py)."""
    from google.protobuf import text_format

    ckpt = open_checkpoint(model)  # fail early on a broken checkpoint, before writing anything
    engine_dirs = _engine_dirs(engines) if engines is not None else []
    if max_batch < 1 or max_tokens_limit < 1 or max_prompt_tokens < 1:
        raise DgpipeError("--max-batch, --max-tokens-limit and --max-prompt-tokens must be >= 1")
    warmup = _warmup_prompt(ckpt)
    cfg = model_config(name, max_batch, max_tokens_limit, max_prompt_tokens, device, warmup)
    with atomic_dir(output) as tmp:
        mdir = tmp / name
        version = model_version_dir(tmp, name)
        version.mkdir(parents=True)
        (mdir / "config.pbtxt").write_text(text_format.MessageToString(cfg))
        shutil.copy(TRITON_MODEL_SOURCE, version / TRITON_MODEL_FILE)
        shutil.copytree(ckpt.path, version / MODEL_CHECKPOINT)
        for d in engine_dirs:
            shutil.copytree(d, target_engine_dir(version, d.name), ignore=shutil.ignore_patterns(".*"))
        if warmup is not None:
            (mdir / "warmup").mkdir()
            data = warmup.encode()
            (mdir / "warmup" / "text_input").write_bytes(struct.pack("<I", len(data)) + data)
            (mdir / "warmup" / "max_tokens").write_bytes(struct.pack("<i", ckpt.config.canvas_length))
    return output


def package_stage(build_dir: Path, limits: EngineLimits) -> tuple[Path, bool]:
    """The package stage of `dgpipe build`: the build's checkpoint (and the engines built here, if any) into
    its model repository, recorded in the build manifest. Returns (repository, engines shipped)."""
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
    )
    record_stage(
        build_dir,
        "package",
        {"model_repository": repo},
        inputs={"checkpoint": checkpoint, **({"engines": built} if built else {})},
        details={"engines": built is not None},
    )
    return repo, built is not None


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


def _warmup_prompt(ckpt) -> str:
    from pipeline.runtime.prompt_format import prompt_format_for

    return prompt_format_for(ckpt, tokenizer=None).example_prompt
