"""`dgpipe export`: checkpoint -> onnx/ (model.onnx + external weights + contract.json), recorded in the
build manifest when a build directory is given. Returns the export summary; `dgpipe export` prints it."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import DgpipeError


def checkpoint_precision(ckpt_dir: Path) -> str:
    """'fp8' / 'nvfp4' for a ModelOpt-quantized checkpoint, else the float dtype it stores ('fp32', 'bf16')."""
    algo = None
    hf_quant = ckpt_dir / "hf_quant_config.json"
    if hf_quant.is_file():
        algo = json.loads(hf_quant.read_text()).get("quantization", {}).get("quant_algo")
    cfg = json.loads((ckpt_dir / "config.json").read_text()) if (ckpt_dir / "config.json").is_file() else {}
    algo = algo or (cfg.get("quantization_config") or {}).get("quant_algo")
    if algo:
        known = {"FP8": "fp8", "NVFP4": "nvfp4"}
        if algo.upper() not in known:
            raise DgpipeError(f"{ckpt_dir}: quantization {algo!r} has no ONNX export", "use FP8 or NVFP4")
        return known[algo.upper()]
    return {"bfloat16": "bf16", "float16": "fp16"}.get(str(cfg.get("dtype", "float32")), "fp32")


def run_export(model_dir: Path, output: Path | None, build_dir: Path | None, from_checkpoint: bool) -> dict:
    """Write the ONNX dir (`output`, default BUILD_DIR/onnx) and record it in the build manifest."""
    from pipeline.builddir import LAYOUT, MANIFEST_NAME, load_or_create, save_manifest
    from pipeline.onnx.export import export_onnx

    if output is None and build_dir is None:
        raise DgpipeError("nowhere to write the ONNX", "pass --output DIR or --build-dir DIR")
    output = output or build_dir / LAYOUT["onnx"]  # type: ignore[operator]
    if not (model_dir / "config.json").is_file():
        raise DgpipeError(
            f"{model_dir}: not a checkpoint (no config.json)", "pass an HF-layout checkpoint dir"
        )
    precision = checkpoint_precision(model_dir)
    if precision == "fp8":
        from pipeline.onnx.quant import export_fp8

        summary = export_fp8(model_dir, output, qdq=from_checkpoint)
    elif precision == "nvfp4":  # TensorRT >= 11 Q/DQ; onnxruntime cannot run TRT_FP4DynamicQuantize
        from pipeline.onnx.quant import export_nvfp4

        summary = export_nvfp4(model_dir, output)
    else:
        from pipeline.model.checkpoint import load_model

        model, _ = load_model(model_dir)  # fp32 on CPU whatever the stored dtype: the reference graph
        summary = export_onnx(model, output, precision=precision)
    result = summary.as_dict()
    if build_dir is not None:
        fields = {"precision": precision}
        if not (build_dir / MANIFEST_NAME).is_file():
            fields |= {"model": str(model_dir), "targets": []}
        man = load_or_create(build_dir, **fields)
        rel = (
            Path(output).resolve().relative_to(Path(build_dir).resolve())
            if Path(output).resolve().is_relative_to(Path(build_dir).resolve())
            else Path(output).resolve()
        )
        man.record(
            "export",
            outputs={"onnx": str(rel)},
            opset=summary.opset,
            model_dtype=summary.model_dtype,
            custom_ops=summary.custom_ops,
            inputs=len(summary.inputs),
            outputs_count=len(summary.outputs),
        )
        result["manifest"] = str(save_manifest(build_dir, man))
    return result
