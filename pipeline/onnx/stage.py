"""`dgpipe export`: checkpoint -> onnx/ (model.onnx + external weights + contract.json), recorded in the
build manifest when a build directory is given. Returns the stage result; `dgpipe export` prints it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pipeline.builddir import holding_build_dir
from pipeline.errors import DgpipeError
from pipeline.stages import StageResult

ONNX_QUANTIZED = ("fp8", "nvfp4")  # precisions whose packed weights pipeline.onnx.quant exports as Q/DQ


def checkpoint_precision(ckpt_dir: Path) -> str:
    """'fp8' / 'nvfp4' for a ModelOpt-quantized checkpoint, else the float dtype it stores ('fp32', 'bf16')."""
    from pipeline.model.modelopt import quant_algo
    from pipeline.targets import precision_for_quant_algo

    algo = quant_algo(ckpt_dir)
    if algo:
        p = precision_for_quant_algo(algo)
        if p is None or p.name not in ONNX_QUANTIZED:
            raise DgpipeError(f"{ckpt_dir}: quantization {algo!r} has no ONNX export", "use FP8 or NVFP4")
        return p.name
    cfg = json.loads((ckpt_dir / "config.json").read_text()) if (ckpt_dir / "config.json").is_file() else {}
    return {"bfloat16": "bf16", "float16": "fp16"}.get(str(cfg.get("dtype", "float32")), "fp32")


@holding_build_dir
def run_export(
    model_dir: Path,
    output: Path | None,
    build_dir: Path | None,
    from_checkpoint: bool,
    moe: str = "routed",
    stream: bool = False,
    step: Callable[[str], None] | None = None,
    dtype: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> StageResult:
    """Write the ONNX dir (`output`, default BUILD_DIR/onnx) and record it in the build manifest.

    `moe`: routed (one dgpipe::MoE node per layer) or dense (debugging); a quantized export is routed when
    every expert is quantized (pipeline.onnx.quant); the form written is recorded either way.
    `from_checkpoint` False: an FP8 checkpoint exports dequantized float weights; NVFP4 has no such form.
    `stream`: the checkpoint is exported without loading it (pipeline.onnx.stream): a float one in its
    stored dtype, a ModelOpt FP8 / NVFP4 one as its Q/DQ graph. `step(name)`: "read checkpoint", then
    export_onnx's EXPORT_STEPS, as each starts (a watched build's progress; the streaming export reports
    `progress` instead).

    `dtype`: the graph's model dtype, "float32" (onnxruntime's CPU provider runs it: the reference) or
    "bfloat16" (what TensorRT builds: a strongly typed engine runs the graph's types, and the FP8 / NVFP4
    expert plugins take bf16 hidden states). Default float32, or with `stream` a float checkpoint's own.
    `progress(bytes done, bytes total)`: the streaming export's weight copy."""
    from pipeline.atomic import check_replaceable
    from pipeline.builddir import LAYOUT, MANIFEST_NAME, record_stage
    from pipeline.onnx import contract as onnx_io
    from pipeline.onnx.export import export_onnx

    if output is None and build_dir is None:
        raise DgpipeError("nowhere to write the ONNX", "pass --output DIR or --build-dir DIR")
    output = output or build_dir / LAYOUT["onnx"]  # type: ignore[operator]
    check_replaceable(output, onnx_io.EXPORT_KIND, onnx_io.CONTRACT_FILE)  # before the model is read
    if dtype is not None and dtype not in GRAPH_DTYPES:
        raise DgpipeError(f"unknown --dtype '{dtype}'", f"choose one of: {', '.join(GRAPH_DTYPES)}")
    from pipeline.model.validate import validate_checkpoint

    validate_checkpoint(model_dir)  # names/shapes/dtypes from the headers; load_model checks finiteness
    from pipeline.onnx.contract import MOE_FORMS

    if moe not in MOE_FORMS:
        raise DgpipeError(f"unknown --moe '{moe}'", f"choose one of: {', '.join(MOE_FORMS)}")
    precision = checkpoint_precision(model_dir)
    if precision not in ONNX_QUANTIZED and dtype is not None:  # an unquantized graph's is its dtype
        precision = GRAPH_DTYPES[dtype]
    model_dtype = _torch_dtype(dtype or "float32")  # of the model an in-memory export traces
    if precision == "nvfp4" and not from_checkpoint:
        raise DgpipeError(
            f"{model_dir}: --no-precision-from-checkpoint has no dequantized form for NVFP4",
            "drop the flag (the export is the NVFP4 Q/DQ graph), or export the unquantized base",
        )
    if stream and precision in ONNX_QUANTIZED and not from_checkpoint:
        raise DgpipeError(
            f"{model_dir}: --stream exports the checkpoint's Q/DQ graph, not its dequantized weights",
            "drop --stream or --no-precision-from-checkpoint",
        )
    if step is not None:
        step("read checkpoint")
    if stream and precision in ONNX_QUANTIZED:
        from pipeline.onnx.stream import export_quantized_streaming

        summary = export_quantized_streaming(
            model_dir, output, precision, dtype=model_dtype, moe=moe, progress=progress
        )
    elif precision == "fp8":
        from pipeline.onnx.quant import export_fp8

        summary = export_fp8(model_dir, output, qdq=from_checkpoint, moe=moe, step=step, dtype=model_dtype)
    elif precision == "nvfp4":  # TensorRT >= 11 Q/DQ; onnxruntime cannot run TRT_FP4DynamicQuantize
        from pipeline.onnx.quant import export_nvfp4

        summary = export_nvfp4(model_dir, output, moe=moe, step=step, dtype=model_dtype)
    elif stream:
        from pipeline.onnx.stream import export_streaming

        convert_to = None if dtype is None else model_dtype  # None: the dtype the checkpoint stores
        summary = export_streaming(model_dir, output, moe=moe, dtype=convert_to, progress=progress)
        precision = summary.precision
    else:
        from pipeline.model.checkpoint import load_model

        # fp32 by default whatever the stored dtype: the reference graph onnxruntime runs
        model, _ = load_model(model_dir, dtype=model_dtype)
        summary = export_onnx(model, output, precision=precision, moe=moe, step=step)
    result = summary.as_dict()
    if build_dir is not None:
        fields = {"precision": precision}
        if not (build_dir / MANIFEST_NAME).is_file():
            fields |= {"model": str(model_dir), "targets": []}
        record_stage(
            build_dir,
            "export",
            {"onnx": Path(output).resolve()},
            inputs={"checkpoint": Path(model_dir).resolve()},
            create=fields,
            details={
                "opset": summary.opset,
                "model_dtype": summary.model_dtype,
                "custom_ops": summary.custom_ops,
                "moe": summary.moe,
                "inputs": len(summary.inputs),
                "outputs_count": len(summary.outputs),
            },
        )
        result["manifest"] = str(Path(build_dir) / MANIFEST_NAME)
    return StageResult("export", {"onnx": Path(output)}, result["seconds"], describe(result), result)


# `--dtype` choices, the model dtype of an exported graph, and the precision an unquantized one records
GRAPH_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def describe(r: dict) -> list[str]:
    """The export summary for a person: the file, its graph's inputs and outputs, custom ops, MoE form."""
    return [
        f"wrote {r['path']} ({r['precision']}, {r['model_dtype']} weights, opset {r['opset']}, "
        f"{r['nodes']} nodes, {r['seconds']:.1f}s)",
        f"  inputs  ({len(r['inputs'])}): {', '.join(_compact(r['inputs']))}",
        f"  outputs ({len(r['outputs'])}): {', '.join(_compact(r['outputs']))}",
        f"  custom ops: {', '.join(r['custom_ops'])} (reference functions embedded for onnxruntime)",
        f"  MoE: {r['moe']}",
    ]


def _compact(names: list[str]) -> list[str]:
    """past.0.key ... past.7.value -> past.{0..7}.{key,value}."""
    found, kv = [], {}
    for n in names:
        parts = n.split(".")
        if len(parts) == 3 and parts[1].isdigit():
            kv.setdefault(parts[0], []).append(int(parts[1]))
            if len(kv[parts[0]]) == 1:
                found.append(parts[0])
        else:
            found.append(n)
    return [f"{n}.{{0..{max(kv[n])}}}.{{key,value}}" if n in kv else n for n in found]
